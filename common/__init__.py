"""What the scripts share. At the top: the parts of one RL step, in the order main() calls them.
Below, the machinery by role: engines/ (who samples), tasks/ (data, rewards, graders, toys),
models/ (where the weights live), run_folder/ (checkpoints, resume), rails/ (checks)."""
