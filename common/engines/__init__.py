"""Who samples the completions. The transformers engine, vLLM colocated or as a server with the
weight sync to it, and multi-turn tool rollouts in a sandbox."""
