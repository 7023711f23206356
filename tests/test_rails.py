"""Safety rails (issue 14): bad input is refused before any weights load, in one line that names the flag; a broken
run stops itself without saving; a run folder is never overwritten or shared; a resume keeps its settings;
--save_total_limit keeps the last N checkpoints.

The table runs each case the way the command line would (parse_args, then the script's main) in this process, with
weight loading made to fail the test: a case passes only if it is refused before the first from_pretrained of a model.
A few cases run as real subprocesses, to show the command line prints no traceback.
"""

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import transformers
from conftest import free_port, read_metrics, run_bounded, run_script, subprocess_env
from safetensors.torch import load_file

from common.args import parse_args, parse_flags
from common.engines.vllm_engine import vllm_available
from common.rails import checks
from common.tasks.toy import TOY_DIR, TOY_VERSION, build_model, build_tokenizer, default_seed, make_splits
from evals import ALGORITHMS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--preset", "toy", "--batch_size", "16", "--num_generations", "4", "--micro_batch_size", "4",
         "--eval_steps", "0", "--total_steps", "1", "--learning_rate", "1e-3"]

# Files a careful user might pass by mistake (written under the toy working directory, in bad/).
BAD_FILES = {
    "empty.jsonl": "",
    "rewards.py": "def needs_solution(completions, *, solution, **kwargs):\n    return [0.0] * len(completions)\n\n\n"
                  "def breaks(prompts, completions, **_):\n    return [1 / 0 for _ in completions]\n",
    "raises.py": "def parse(text):\n    return int(text) / 0\n\n\n"
                 "def graded(completions, **kwargs):\n    return [parse(c) for c in completions]\n",
    "notes.txt": "12+34=\n",
    "ints.jsonl": '{"prompt": 12, "answer": 46}\n{"prompt": 3, "answer": 7}\n',
    "questions.jsonl": '{"question": "1+1=", "solution": "2"}\n',
    "list_target.yaml": "lora_r: 4\nlora_target_modules: [q_proj, v_proj]\n",
    "float_steps.yaml": "save_steps: 10.0\n",
    "a_list.yaml": "- batch_size: 16\n",
    "broken.yaml": "batch_size: [16\n",
    "typo.yaml": "learning_rat: 1.0e-3\n",
    "trl_config.yaml": "per_device_train_batch_size: 4\n",  # a field of TRL's GRPOConfig
    "dtype.yaml": "dtype: float64\n",
    "weights_list.yaml": "reward_weights: [1, 0.1]\n",
    "word_decay.yaml": "weight_decay: lots\n",
    "bool_word.yaml": "use_chat_template: maybe\n",
    "template_int.yaml": "prompt_template: 12\n",
    "no_answers.jsonl": '{"prompt": "1+1=", "answer": ""}\n{"prompt": "2+2=", "answer": null}\n',
    "empty_prompt.jsonl": '{"prompt": "1+1=", "answer": "2"}\n{"prompt": " ", "answer": "4"}\n',
}

TRAIN_CASES = [
    # the "exit 0 with a broken result"
    ("grpo", ["--temperature", "0"], "--temperature 0.0 must be > 0"),
    ("grpo", ["--temperature=-1"], "--temperature -1.0 must be > 0"),
    ("grpo", ["--top_p", "0"], "--top_p 0.0 must be in (0, 1]: top_p <= 0 keeps no token"),
    # issue 68: each side of a range gives its own reason (1.5 was refused with the reason of <= 0)
    ("grpo", ["--top_p", "1.5"],
     "--top_p 1.5 must be in (0, 1]: it is a share of the probability mass"),
    ("grpo", ["--beta=-0.5"], "--beta -0.5 must be >= 0"),
    ("grpo", ["--lora_r=-1"], "--lora_r -1 must be >= 0"),
    ("snib", ["--reward_noise=-1"], "--reward_noise -1.0 must be >= 0"),
    # numbers out of range
    ("grpo", ["--micro_batch_size", "0"], "--micro_batch_size 0 must be at least 1"),
    ("grpo", ["--max_completion_length", "0"], "--max_completion_length 0 must be at least 1"),
    ("grpo", ["--num_iterations", "0"], "--num_iterations 0 must be at least 1"),
    ("grpo", ["--batch_size=-16"], "--batch_size -16 must be at least 1"),
    ("grpo", ["--learning_rate=-1e-3"], "--learning_rate -0.001 must be >= 0"),
    ("grpo", ["--total_steps", "0"], "--total_steps 0 must be at least 1"),
    ("grpo", ["--max_prompt_length", "0"], "--max_prompt_length 0 must be at least 1"),
    ("grpo", ["--max_grad_norm", "0"], "--max_grad_norm 0.0 must be > 0"),
    ("grpo", ["--seed=-1"], "--seed -1 must be in [0, 2**32)"),
    ("grpo", ["--save_steps=-1"], "--save_steps -1 must be >= 0"),
    ("grpo", ["--save_total_limit=-1"], "--save_total_limit -1 must be >= 0"),
    ("grpo", ["--eval_steps=-1"], "--eval_steps -1 must be >= 0"),
    ("grpo", ["--eval_steps", "5", "--eval_num_prompts", "0"], "--eval_num_prompts 0 must be at least 1"),
    ("grpo", ["--eval_num_samples", "0"], "--eval_num_samples 0 must be at least 1"),
    ("grpo", ["--warmup_steps=-5"], "--warmup_steps -5 must be >= 0"),
    ("grpo", ["--weight_decay=-0.1"], "--weight_decay -0.1 must be >= 0"),
    ("grpo", ["--tis_cap=-1"], "--tis_cap -1.0 must be >= 0"),
    ("snib", ["--rollout_lag=-1"], "--rollout_lag -1 must be >= 0"),
    ("grpo", ["--max_turns", "0"], "--max_turns 0 must be at least 1"),
    ("ctpo", ["--max_turns", "2", "--tool", "bash"], "--tool 'bash': choose one of"),
    ("ctpo", ["--max_refill_rounds=-2"], "--max_refill_rounds -2 must be >= 0"),
    ("p3o", ["--overlong_penalty=-1"], "--overlong_penalty -1.0 must be >= 0"),
    ("gspo", ["--max_completion_length", "6", "--overlong_buffer", "6"],
     "--overlong_buffer 6 must be below --max_completion_length 6"),
    ("grpo", ["--vllm_gpu_memory_utilization", "1.5"],
     "--vllm_gpu_memory_utilization 1.5 must be in (0, 1]: it is a share of one GPU's memory"),
    ("grpo", ["--vllm_gpu_memory_utilization", "0"],
     "--vllm_gpu_memory_utilization 0.0 must be in (0, 1]: vLLM needs some of the GPU's memory"),
    ("grpo", ["--vllm_tensor_parallel_size", "0"], "--vllm_tensor_parallel_size 0 must be at least 1"),
    ("grpo", ["--gradient_checkpointing", "--gradient_checkpointing_every", "0"],
     "--gradient_checkpointing_every 0 must be at least 1"),
    ("grpo", ["--logprob_batch_size=-1"], "--logprob_batch_size -1 must be >= 0"),
    ("grpo", ["--dump_stats_steps=-1"], "--dump_stats_steps -1 must be >= 0"),
    ("grpo", ["--epsilon=-0.1"], "--epsilon -0.1 must be >= 0"),
    ("grpo", ["--lora_r", "4", "--lora_alpha", "0"], "--lora_alpha 0 must be > 0 with --lora_r 4"),
    # batch geometry
    ("grpo", ["--num_generations", "1"], "--num_generations 1 must be at least 2"),
    ("grpo", ["--num_generations", "3"], "--num_generations 3 must divide --batch_size 16"),
    ("grpo", ["--micro_batch_size", "5"], "--micro_batch_size 5 must divide the 16 rows"),
    ("grpo", ["--mini_batch_size", "6"], "--mini_batch_size 6 must divide --batch_size 16"),
    # names that must exist
    ("grpo", ["--lora_r", "4", "--lora_target_modules", "q_proj,v_projj"],
     "--lora_target_modules: v_projj not in qwen3"),
    ("grpo", ["--report_to", "tensorbored"], "--report_to 'tensorbored': choose none or one of"),
    ("grpo", ["--lr_scheduler_type", "cosin"], "--lr_scheduler_type 'cosin' is not a transformers scheduler"),
    ("grpo", ["--lr_scheduler_type", "reduce_lr_on_plateau"], "--lr_scheduler_type reduce_lr_on_plateau cannot run"),
    ("grpo", ["--lr_scheduler_type", "warmup_stable_decay"], "--lr_scheduler_type warmup_stable_decay cannot run"),
    ("grpo", ["--warmup_steps", "100"], "--warmup_steps 100 with --lr_scheduler_type constant would train at the full"),
    ("grpo", ["--prompt_template", "What is it?"], "--prompt_template 'What is it?' has no {prompt}"),
    ("grpo", ["--reward_funcs", "toy_additon"], "--reward_funcs: unknown reward function 'toy_additon'"),
    ("grpo", ["--reward_funcs", "no_such_module:fn"], "--reward_funcs: cannot import reward function"),
    ("grpo", ["--reward_funcs", "common.tasks.rewards:no_such_fn"], "--reward_funcs: cannot import reward function"),
    ("grpo", ["--reward_funcs", "common.tasks.math_grader:TIME_LIMIT_S"],
     "--reward_funcs: 'common.tasks.math_grader:TIME_LIMIT_S' is not callable"),
    ("grpo", ["--reward_funcs", "toy_addition,"], "--reward_funcs: unknown reward function ''"),
    ("grpo", ["--reward_weights", "1,2"], "--reward_weights gives 2 weights for 1 --reward_funcs"),
    ("grpo", ["--reward_weights", "one"], "--reward_weights 'one': 'one' is not a finite number"),
    ("grpo", ["--reward_weights", "nan"], "--reward_weights 'nan': 'nan' is not a finite number"),
    ("grpo", ["--eval_steps", "5", "--eval_benchmarks", "math501"], "--eval_benchmarks: unknown benchmark 'math501'"),
    ("grpo", ["--eval_steps", "5", "--eval_benchmarks", "toy=no/such/toy.jsonl"], "no such file 'no/such/toy.jsonl'"),
    ("grpo", ["--resume_overrides", "batch_sise"], "--resume_overrides: batch_sise not a field"),
    # paths and data
    ("grpo", ["--model", "./no/such/model"], "cannot load --model './no/such/model': no such directory"),
    ("grpo", ["--model", "runs/toy"], "no config.json (not a save_pretrained folder); did you mean runs/toy/model?"),
    ("grpo", ["--dataset", "bad/not_utf8.jsonl"],
     "--dataset 'bad/not_utf8.jsonl': rows 0 to 9999 are not UTF-8 text ('utf-8' codec can't decode byte 0xe9"),
    ("grpo", ["--dataset", "bad/not_json.jsonl"],
     "Could not read 'bad/not_json.jsonl': UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff"),
    # tokenizers as they come: none saved (it loaded as one token), no EOS (every completion ran to the limit), a
    # chat template refusing a system turn (a jinja traceback)
    ("grpo", ["--model", "bad/tokenless"], "its tokenizer has 1 token: the folder has no tokenizer files"),
    ("grpo", ["--model", "bad/eosless"], "its tokenizer has no end-of-sequence token, so no completion could end"),
    ("grpo", ["--model", "bad/no_system", "--system_prompt", "Be brief."],
     "its chat template refuses the --system_prompt turn (TemplateError: System role not supported)"),
    # issue 68: the toy's chat template takes TRL's conversations, but no system turn
    ("grpo", ["--system_prompt", "Be brief."],
     "its chat template refuses the --system_prompt turn (TemplateError: the toy has no system "),
    ("grpo", ["--dataset", "./no/such/data.jsonl"], "--dataset './no/such/data.jsonl': no such file or directory"),
    ("grpo", ["--dataset", "data/train.jsonl"], "--dataset 'data/train.jsonl': no such file or directory"),
    ("grpo", ["--dataset", "bad/empty.jsonl"], "--dataset 'bad/empty.jsonl'"),
    ("grpo", ["--dataset", "bad/notes.txt"], "--dataset 'bad/notes.txt': unsupported file type"),
    ("grpo", ["--dataset", "bad/ints.jsonl"], "2 of 2 rows of --prompt_column 'prompt' are not text (the first, row 0, "
                                              "is int 12); prompts must be text"),
    ("grpo", ["--dataset", "bad/empty_prompt.jsonl"], "1 of 2 rows of --prompt_column 'prompt' are not text (the "
                                                      "first, row 1, is empty)"),
    ("grpo", ["--dataset", "bad/no_answers.jsonl"], "--answer_column 'answer' is empty in every row, so every reward"),
    ("grpo", ["--model", "bad/weightless"], "cannot load --model 'bad/weightless': the folder has a config.json but no "
                                            "weights"),
    ("grpo", ["--reward_funcs", "os:getcwd"],
     "--reward_funcs: reward function 'os:getcwd' takes (); write it as TRL's def f(completions, **kwargs)"),
    ("grpo", ["--reward_funcs", "no_such_module:fn"],
     "No module named 'no_such_module' (Python looks in the script's folder and on PYTHONPATH); give its file "
     "instead, e.g. path/to/no_such_module.py:fn"),
    ("grpo", ["--reward_funcs", "bad/no_such_file.py:fn"], "cannot import reward function 'bad/no_such_file.py:fn': "
                                                           "no such file: bad/no_such_file.py"),
    ("grpo", ["--reward_funcs", "bad/rewards.py"], "names a file but no function in it; give both, e.g. "
                                                   "bad/rewards.py:my_function"),
    ("grpo", ["--reward_funcs", "bad/rewards.py:needs_solution"], "failed: reward function 'needs_solution' raised "
                                                                  "TypeError: needs_solution() missing 1 required "
                                                                  "keyword-only argument: 'solution'"),
    ("grpo", ["--reward_funcs", "bad/rewards.py:breaks"], "failed: reward function 'breaks' raised ZeroDivisionError: "
                                                          "division by zero at sample 0: prompt: "),
    # issue 68: where in the user's file (the innermost line of it: a helper of the reward function)
    ("grpo", ["--reward_funcs", "bad/raises.py:graded"], "(raised at bad/raises.py:2, in parse)"),
    ("grpo", ["--prompt_column", "question"], "has no column 'question' (its columns: prompt, answer); name the "
                                              "right one with --prompt_column"),
    ("grpo", ["--answer_column", "solution"], "name the right one with --answer_column"),
    ("grpo", ["--dataset", "bad/questions.jsonl"], "--dataset 'bad/questions.jsonl' has no column 'prompt' (its "
                                                   "columns: question, solution)"),
    ("grpo", ["--eval_steps", "5", "--eval_benchmarks", "toy=bad/questions.jsonl"], "bad/questions.jsonl has no "
                                                                                   "column 'prompt'"),
    ("grpo", ["--eval_steps", "5", "--eval_dataset", "./no/such/test.jsonl"], "--eval_dataset './no/such/test.jsonl'"),
    ("grpo", ["--resume_from", "./no/such/run"], "--resume_from './no/such/run': no such directory"),
    ("grpo", ["--resume_from", "runs/toy"], "--resume_from 'runs/toy' is neither a checkpoint"),
    # the command line and --config files
    ("grpo", ["--dtype", "float64"], "invalid choice: 'float64'"),
    ("grpo", ["--batch_size", "lots"], "invalid int value: 'lots'"),
    # issue 68: no abbreviations (--learning_rat trained as --learning_rate); TRL's names and
    # habits answered
    ("grpo", ["--learning_rat", "1e-3"],
     "unknown arguments --learning_rat 1e-3 (did you mean --learning_rate?)"),
    ("grpo", ["--learning_rat", "1e-3", "--bogus", "1"],
     "unknown arguments --learning_rat 1e-3 --bogus 1 "
     "(--learning_rat: did you mean --learning_rate?)"),
    ("grpo", ["--lr", "1e-3"], "unknown arguments --lr 1e-3 (did you mean --learning_rate?)"),
    ("grpo", ["--conf", "bad/typo.yaml"], "unknown arguments --conf bad/typo.yaml (did you mean --config?)"),
    ("grpo", ["--per_device_train_batch_size", "4"],
     "(here --micro_batch_size (completions per forward on each process); --batch_size counts"),
    ("grpo", ["--max-steps", "10"], "unknown arguments --max-steps 10 (here --total_steps"),
    ("grpo", ["--config", "bad/trl_config.yaml"],
     "sets 'per_device_train_batch_size', not a field of Args: here --micro_batch_size"),
    ("grpo", ["--preset", "nope"], "unknown --preset 'nope'"),
    ("grpo", ["--config", "bad/missing.yaml"], "--config 'bad/missing.yaml': No such file or directory"),
    ("grpo", ["--config", "bad/list_target.yaml"], "--lora_target_modules must be a string, got list ['q_proj', "
                                                   "'v_proj'] (from bad/list_target.yaml); write it as one"),
    ("grpo", ["--config", "bad/float_steps.yaml"], "--save_steps must be an integer, got float 10.0"),
    ("grpo", ["--config", "bad/a_list.yaml"], "must be a mapping of Args fields"),
    ("grpo", ["--config", "bad/broken.yaml"], "--config 'bad/broken.yaml' is not valid YAML at line"),
    ("grpo", ["--config", "bad/typo.yaml"],
     "sets 'learning_rat', not a field of Args: did you mean learning_rate?"),
    ("grpo", ["--config", "bad/dtype.yaml"], "--dtype must be one of bfloat16, float16, float32, got str 'float64'"),
    ("grpo", ["--config", "bad/weights_list.yaml"], "--reward_weights must be a string or null, got list"),
    ("grpo", ["--config", "bad/word_decay.yaml"], "invalid float value: 'lots'"),
    ("grpo", ["--config", "bad/bool_word.yaml"], "argument --use_chat_template"),
    ("grpo", ["--config", "bad/template_int.yaml"], "--prompt_template must be a string, got int 12"),
    # the siblings: their own fields, and shared checks through each script's main
    ("gspo", ["--temperature", "0"], "--temperature 0.0 must be > 0"),
    ("gspo", ["--beta=-0.1"], "--beta -0.1 must be >= 0"),
    ("gspo", ["--epsilon_high=-1e-4"], "--epsilon_high -0.0001 must be >= 0"),
    ("gspo", ["--model", "no/such/model"], "cannot load --model 'no/such/model': no such directory"),
    ("gspo", ["--num_generations", "5"], "--num_generations 5 must divide --batch_size 16"),
    ("snib", ["--beta=-0.5"], "--beta -0.5 must be >= 0"),
    ("snib", ["--epsilon=-1"], "--epsilon -1.0 must be >= 0"),
    ("snib", ["--dataset", "./missing.jsonl"], "--dataset './missing.jsonl': no such file or directory"),
    ("snib", ["--config", "bad/list_target.yaml"], "--lora_target_modules must be a string"),
    ("snib", ["--top_p", "0"], "--top_p 0.0 must be in (0, 1]"),
    ("ctpo", ["--clip_low=-0.1"], "--clip_low -0.1 must be >= 0"),
    ("ctpo", ["--clip_high=-0.1"], "--clip_high -0.1 must be >= 0"),
    ("ctpo", ["--clip_c=-1"], "--clip_c -1.0 must be >= 0"),
    ("ctpo", ["--clip_power=-1"], "--clip_power -1.0 must be >= 0"),
    ("ctpo", ["--reward_funcs", "nope"], "--reward_funcs: unknown reward function 'nope'"),
    ("p3o", ["--entropy_coeff=-0.01"], "--entropy_coeff -0.01 must be >= 0"),
    ("p3o", ["--beta=-1"], "--beta -1.0 must be >= 0"),
    ("p3o", ["--micro_batch_size", "0"], "--micro_batch_size 0 must be at least 1"),
    ("p3o", ["--lora_r", "8", "--lora_target_modules", "qkv"], "--lora_target_modules: qkv not in qwen3"),
    ("p3o", ["--lr_scheduler_type", "linar"], "--lr_scheduler_type 'linar' is not a transformers scheduler"),
    ("reinforcepp", ["--beta=-0.01"], "--beta -0.01 must be >= 0"),
    ("reinforcepp", ["--clip_ratio_c", "0.5"], "--clip_ratio_c 0.5 must be >= 1"),
    ("maxrl", ["--epsilon=-0.2"], "--epsilon -0.2 must be >= 0"),
    ("maxrl", ["--clip_ratio_c", "0"], "--clip_ratio_c 0.0 must be >= 1"),
    ("covpo", ["--clip_cov_ratio=-0.1"], "--clip_cov_ratio -0.1 must be >= 0"),
    ("covpo", ["--kl_cov_ratio=-0.1"], "--kl_cov_ratio -0.1 must be >= 0"),
    ("covpo", ["--ppo_kl_coef=-1"], "--ppo_kl_coef -1.0 must be >= 0"),
    ("covpo", ["--cov_method", "entropy"], "invalid choice: 'entropy'"),
    ("ipo", ["--eps=-0.3"], "--eps -0.3 must be >= 0"),
    ("ipo", ["--kl_tau=-0.001"], "--kl_tau -0.001 must be >= 0"),
    ("grpo", ["--tis_cap", "5", "--mis", "--tis_floor=-0.5"], "--tis_floor -0.5 must be >= 0"),
    ("grpo", ["--tis_cap", "5", "--mis", "--tis_floor", "5"], "--tis_floor 5.0 must be below --tis_cap 5.0"),
    ("grpo", ["--tis_cap", "2", "--tis_floor", "0.5"], "--tis_floor 0.5 needs --mis"),
    ("dro", ["--tau=-0.05"], "--tau -0.05 must be >= 0"),
    ("dro", ["--beta=-1"], "--beta -1.0 must be >= 0"),
    ("vespo", ["--k_pos=-1"], "--k_pos -1.0 must be >= 0"),
    ("vespo", ["--lambda_neg=-2"], "--lambda_neg -2.0 must be >= 0"),
    ("luspo", ["--epsilon=-0.2"], "--epsilon -0.2 must be >= 0"),
    ("luspo", ["--beta=-1"], "--beta -1.0 must be >= 0"),
    ("gdpo", ["--epsilon_high=-0.2"], "--epsilon_high -0.2 must be >= 0"),
    ("gdpo", ["--beta=-0.04"], "--beta -0.04 must be >= 0"),
    ("sdpo", ["--teacher_update_rate=-0.05"], "--teacher_update_rate -0.05 must be >= 0"),
    ("sdpo", ["--distillation_is_clip=-2"], "--distillation_is_clip -2.0 must be >= 0"),
    ("sdpo", ["--teacher", "best"], "invalid choice: 'best'"),
    ("sdpo", ["--dynamic_sampling"], "--dynamic_sampling: sdpo.py re-prompts from the step's own groups"),
    ("sdpo", ["--reprompt_template", "{question}{solution}"], "--reprompt_template: KeyError 'question' (its fields: "
                                                              "{prompt}, {solution}, {feedback}"),
    ("sdpo", ["--solution_template", "{"], "--solution_template: ValueError"),
    ("sdpo", ["--feedback_template", "{hint}"], "--feedback_template: KeyError 'hint' (its fields: {feedback_raw})"),
    ("sdpo", ["--solution_template", "{prompt}: {successful_previous_attempt}"],
     "--solution_template: KeyError 'prompt' (its fields: {successful_previous_attempt})"),
    ("sdpo", ["--feedback_column", "hint"], "--feedback_column 'hint': the data has no such column"),
]
if not vllm_available():
    TRAIN_CASES.append(("grpo", ["--rollout_engine", "vllm"], "--rollout_engine vllm needs vLLM: pip install"))
if importlib.util.find_spec("wandb") is None:
    TRAIN_CASES.append(("grpo", ["--report_to", "wandb"], "the package 'wandb' is not installed; pip install it or "
                                                          "pass --report_to none"))

EVAL_CASES = [
    (["--n", "0"], "--n 0 must be at least 1"),
    (["--max_tokens", "0"], "--max_tokens 0 must be at least 1"),
    (["--top_p", "0"], "--top_p 0.0 must be in (0, 1]"),
    (["--temperature=-1"], "--temperature -1.0 must be >= 0"),
    (["--batch_size", "0"], "--batch_size 0 must be at least 1"),
    (["--max_questions=-1"], "--max_questions -1 must be >= 0"),
    (["--seed=-1"], "--seed -1 must be >= 0"),
    (["--vllm_gpu_memory_utilization", "0"], "--vllm_gpu_memory_utilization 0.0 must be in (0, 1]"),
    (["--benchmarks", ""], "--benchmarks is empty"),
    (["--benchmarks", "toy,math501"], "--benchmarks: unknown benchmark 'math501'"),
    (["--benchmarks", "toy=toy_copy.jsonl"], "--benchmarks toy=toy_copy.jsonl: no such file 'toy_copy.jsonl'"),
    (["--benchmarks", "math500", "--data_dir", "bad"], "--benchmarks: benchmark 'math500': no file math500.jsonl"),
    (["--benchmarks", "toy=bad/questions.jsonl"], "--benchmarks: benchmark 'toy': bad/questions.jsonl has no column "
                                                  "'prompt'"),
    (["--data_dir", "./no/such/dir"], "--data_dir './no/such/dir': no such directory"),
    (["--model", "./no/such/model"], "cannot load --model './no/such/model': no such directory"),
    (["--imports", "no_such_module"], "--imports 'no_such_module': ModuleNotFoundError"),
    (["--engine", "sglang"], "invalid choice: 'sglang'"),
]
PLOT_CASES = [  # (files of the run folder, extra flags, message)
    ({"metrics.jsonl": ""}, [], "metrics.jsonl is empty: the run has logged no step yet"),
    ({"metrics.jsonl": '{"step": 1, "reward/mean": 0.5}\n{"step": 2, "rew'}, [], "metrics.jsonl line 2 is not JSON"),
    ({"metrics.jsonl": '[1, 2]\n'}, [], "holds lines without a 'step'"),
    ({"metrics.jsonl": '{"step": 1, "reward/mean": 0.5}\n', "args.json": "{"}, [], "args.json is not JSON"),
    ({"metrics.jsonl": '{"step": 1, "time/step": 1.0}\n'}, [], "no figure drawn: the runs logged none of"),
    ({}, [], "has no metrics.jsonl"),
    ({"metrics.jsonl": '{"step": 1, "reward/mean": 0.5}\n'}, ["--smooth", "0"], "--smooth 0 must be at least 1"),
    ({"metrics.jsonl": '{"step": 1, "reward/mean": 0.5}\n'}, ["--ctpo_steps", "a,b"], "--ctpo_steps 'a,b' must be"),
    ({"metrics.jsonl": '{"step": 1, "reward/mean": 0.5}\n'}, ["--colour", "red"], "unknown arguments --colour red"),
]
COMPARE_CASES = [
    (["--algos", "grpo,ppo"], "--algos: no script ppo.py; choose from " + ",".join(ALGORITHMS)),
    (["--algos", ""], "--algos is empty"),
    (["--seeds", "0"], "--seeds 0 must be at least 1"),
    (["--jobs", "0"], "--jobs 0 must be at least 1"),
    (["--preset", "huge"], "--preset 'huge': choose one of ['smollm2', 'toy', 'toy_tir']"),
    (["--extra", "--run_name 'unclosed"], "--extra \"--run_name 'unclosed\": No closing quotation"),
    (["--algos", "grpo", "--extra", "--temperature 0"], "grpo: --temperature 0.0 must be > 0"),
    (["--algos", "snib", "--extra", "--reward_noise=-1"], "snib: --reward_noise -1.0 must be >= 0"),
    (["--algos", "grpo", "--tag", "used"], "runs/compare-used/grpo__s1 holds a run already; pass another --tag"),
]


@pytest.fixture(scope="module")
def quick_toy(tmp_path_factory):
    """runs/toy as prepare_toy leaves it, but without the warm start (minutes): nothing here needs a model that
    can add, only files where the toy preset looks for them."""
    workdir = tmp_path_factory.mktemp("rails")
    toy = workdir / TOY_DIR
    train, test = make_splits(seed=0)
    toy.mkdir(parents=True)
    for name, rows in [("train", train), ("test", test)]:
        (toy / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0).save_pretrained(toy / "model")
    tokenizer.save_pretrained(toy / "model")
    built = {"version": TOY_VERSION, "seed": default_seed(), "target_accuracy": 0.35}
    (toy / "toy.json").write_text(json.dumps(built))  # prepare_toy: already built
    bad = workdir / "bad"
    bad.mkdir()
    for name, text in BAD_FILES.items():
        (bad / name).write_text(text)
    tokenizer.save_pretrained(bad / "weightless")  # a model folder with its config and tokenizer, but no weights
    build_model(tokenizer, seed=0).config.save_pretrained(bad / "weightless")
    (bad / "not_utf8.jsonl").write_bytes(b'{"prompt": "caf\xe9 1+1=", "answer": "2"}\n')  # Latin-1, as exports come
    (bad / "not_json.jsonl").write_bytes(b'\xff\xfe{"prompt": "1+1=", "answer": "2"}\n')  # a UTF-16 byte-order mark
    # weights and config; tokenizer: none, no EOS, a strict template, no template
    for name in ("tokenless", "eosless", "no_system", "plain"):
        build_model(tokenizer, seed=0).save_pretrained(bad / name)
    build_tokenizer(chat_template=None).save_pretrained(bad / "plain")
    eosless, strict = build_tokenizer(), build_tokenizer()
    eosless.eos_token = None
    eosless.save_pretrained(bad / "eosless")
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role "
                            "not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")  # as several families do
    strict.save_pretrained(bad / "no_system")
    return workdir


@pytest.fixture
def workdir(quick_toy, monkeypatch):
    monkeypatch.chdir(quick_toy)
    return quick_toy


@pytest.fixture
def no_weights(monkeypatch):
    """Loading a model's weights, or starting a run from evals.compare, fails the test: every refusal must come
    before them."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded (or a run started) before the bad input was refused")

    monkeypatch.setattr(transformers.modeling_utils.PreTrainedModel, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


def refusal(call, capsys) -> str:
    """The one-line message of a SystemExit (ours carry it; argparse prints it and exits 2), with no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        call()
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    code = exit_info.value.code
    message = code if isinstance(code, str) else err.strip().splitlines()[-1]
    assert code not in (0, None), "a refusal must not exit 0"
    assert message.startswith("error: ") or ": error: " in message, message
    assert "\n" not in message, f"one line per problem:\n{message}"
    return message


@pytest.mark.parametrize("script, flags, expected", TRAIN_CASES, ids=[f"{s}{' '.join(f)}" for s, f, _ in TRAIN_CASES])
def test_bad_training_input_is_refused_before_any_weights_load(workdir, no_weights, capsys, script, flags, expected):
    argv = flags + SMALL[2:] if flags[0] == "--preset" else SMALL + flags
    assert expected in refusal(lambda: run_script(importlib.import_module(script), argv), capsys)


@pytest.mark.parametrize("flags, expected", EVAL_CASES, ids=[" ".join(f) for f, _ in EVAL_CASES])
def test_bad_eval_input_is_refused_before_the_model_loads(workdir, no_weights, capsys, flags, expected):
    from evals import run

    argv = ["--model", "runs/toy/model", "--benchmarks", "toy", "--engine", "hf", *flags]
    assert expected in refusal(lambda: run.main(parse_flags(run.EvalArgs, argv)), capsys)


@pytest.mark.parametrize("files, flags, expected", PLOT_CASES, ids=[m for _, _, m in PLOT_CASES])
def test_bad_plot_input_is_refused(tmp_path, capsys, files, flags, expected):
    from evals import plot

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name, text in files.items():
        (run_dir / name).write_text(text)
    assert expected in refusal(lambda: plot.main(*plot.parse_cli([str(run_dir), *flags])), capsys)
    assert not (run_dir / "plots").exists()


@pytest.mark.parametrize("flags, expected", COMPARE_CASES, ids=[" ".join(f) for f, _ in COMPARE_CASES])
def test_bad_compare_input_is_refused_before_any_run_starts(workdir, no_weights, capsys, flags, expected):
    from evals import compare

    (workdir / "runs" / "compare-used" / "grpo__s1").mkdir(parents=True, exist_ok=True)
    (workdir / "runs" / "compare-used" / "grpo__s1" / "metrics.jsonl").write_text('{"step": 1}\n')
    args = compare.CompareArgs(**{k[2:]: type(getattr(compare.CompareArgs, k[2:]))(v)
                                  for k, v in zip(flags[::2], flags[1::2])})
    assert expected in refusal(lambda: compare.main(args), capsys)


def test_every_problem_gets_its_own_line(workdir, no_weights, capsys):
    import gspo

    with pytest.raises(SystemExit) as exit_info:
        run_script(gspo, SMALL + ["--temperature", "0", "--top_p", "2", "--beta=-1"])
    lines = exit_info.value.code.splitlines()
    assert [line.split()[1] for line in lines] == ["--temperature", "--top_p", "--beta"]
    assert all(line.startswith("error: ") for line in lines)


def test_the_command_line_prints_one_line_and_no_traceback(workdir):
    """Real processes (the table runs in this one; each process takes ~10 s to import torch here): a script with
    a --config file and a bad flag, `python grpo.py` on a machine without a GPU (CUDA hidden), and evals.run."""
    env = {**subprocess_env(), "CUDA_VISIBLE_DEVICES": ""}
    commands = {
        "ctpo.py --config (a list)": [os.path.join(REPO, "ctpo.py"), *SMALL, "--config", "bad/list_target.yaml"],
        "grpo.py": [os.path.join(REPO, "grpo.py")],
        "evals.run --n 0": ["-m", "evals.run", "--model", "runs/toy/model", "--benchmarks", "toy", "--n", "0"],
    }
    running = {name: subprocess.Popen([sys.executable, *cmd], cwd=workdir, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for name, cmd in commands.items()}
    for name, process in running.items():
        out, err = process.communicate(timeout=300)
        assert process.returncode == 1, (name, err[-2000:])
        assert "Traceback" not in out + err, (name, err[-2000:])
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, (name, err[-2000:])
        if name == "grpo.py":
            assert "pass --preset with one that runs on a CPU (toy, toy_tir, smollm2)" in errors[0], errors
    assert "--n 0 must be at least 1" in errors[0]


def test_hub_ids_without_network_fail_in_seconds_naming_the_fix(workdir, no_weights, capsys, monkeypatch):
    """No network (the hub's address a closed local port): one line in a few seconds, before any weights load and
    before huggingface_hub's retries (~29 s), naming HF_HUB_OFFLINE and how to fill the cache."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    start = time.monotonic()
    message = refusal(lambda: run_script(importlib.import_module("grpo"), [
        "--model", "Qwen/Qwen3-4B", "--dataset", "gsm8k", "--report_to", "none"]), capsys)
    assert time.monotonic() - start < 5, time.monotonic() - start
    assert "cannot be reached" in message and "set HF_HUB_OFFLINE=1 to use the local cache only" in message
    assert "hf download Qwen/Qwen3-4B; datasets.load_dataset('openai/gsm8k', 'main')" in message


def test_a_missing_local_path_is_a_missing_path_even_without_network(workdir, no_weights, capsys, monkeypatch):
    """A typo in a local --model or --dataset is said as such, not blamed on a hub that cannot be reached (the
    default data set, gsm8k, is a hub id)."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    grpo = importlib.import_module("grpo")
    message = refusal(lambda: run_script(grpo, ["--model", "/nonexistent", "--report_to", "none"]), capsys)
    assert "cannot load --model '/nonexistent': no such directory" in message and "cannot be reached" not in message
    message = refusal(lambda: run_script(grpo, ["--model", "Qwen/Qwen3-4B", "--dataset", "data/mine.jsonl",
                                                "--report_to", "none"]), capsys)
    assert message == "error: --dataset 'data/mine.jsonl': no such file or directory", message


def test_the_command_line_honours_hf_endpoint_and_hf_hub_offline(workdir, tmp_path):
    """Real processes, each environment variable read as huggingface_hub reads it: HF_ENDPOINT at a closed port is
    refused without one retry; HF_HUB_OFFLINE=1 with an empty cache names what is missing and how to fetch it,
    and a preset's data set is not sent back to "one of the presets"."""
    base = {**subprocess_env(), "HF_HOME": str(tmp_path / "hf")}
    base.pop("HF_HUB_OFFLINE", None), base.pop("TRANSFORMERS_OFFLINE", None)
    hub = [os.path.join(REPO, "grpo.py"), "--dataset", "gsm8k", "--report_to", "none", "--model"]
    closed, offline = {**base, "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}, {**base, "HF_HUB_OFFLINE": "1"}
    runs = {"no network": (closed, hub + ["Qwen/Qwen3-4B"]), "offline": (offline, hub + ["Qwen/Qwen3-4B"]),
            "offline data": (offline, hub + ["runs/toy/model"])}
    start = time.monotonic()
    running = {name: subprocess.Popen([sys.executable, *cmd], cwd=workdir, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for name, (env, cmd) in runs.items()}
    errors = {}
    for name, process in running.items():
        out, err = process.communicate(timeout=300)
        assert process.returncode == 1 and "Traceback" not in err and "Retrying" not in err, (name, err[-2000:])
        errors[name] = [line for line in err.splitlines() if line.startswith("error: ")]
    # three processes importing torch at once: 136 s once on 2 cores busy with a vLLM test run; "Retrying" above is
    # the check of the retries (29 s a file before the fix), this bound only that nothing waits for minutes
    assert time.monotonic() - start < 280
    assert len(errors["no network"]) == 1 and "HF_HUB_OFFLINE=1" in errors["no network"][0]
    [model, _] = errors["offline"]  # and the data set's line
    assert "HF_HUB_OFFLINE is set: fetch it where the hub is reachable (hf download Qwen/Qwen3-4B)" in model
    [data] = errors["offline data"]
    assert "it is the hub data set of the preset gsm8k" in data and "one of the presets" not in data, data
    assert "datasets.load_dataset('openai/gsm8k', 'main')" in data


@pytest.mark.parametrize("model", ["Qwen/Qwen3-4B", "local"])
def test_evals_run_with_hub_ids_and_no_network_fails_in_seconds(tmp_path, workdir, model):
    """`python -m evals.run` without network, whether its model or only its benchmark's data is on the hub: one line
    naming what it needs and the fix (a local copy with --data_dir), without huggingface_hub's retries (about 30 s
    a file), and not the training presets."""
    env = {**subprocess_env(), "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    env.pop("HF_HUB_OFFLINE", None)
    model = str(workdir / TOY_DIR / "model") if model == "local" else model
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "evals.run", "--model", model, "--benchmarks", "math500"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "Retrying" not in proc.stderr, proc.stderr
    assert time.monotonic() - start < 60
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert "cannot be reached" in line and "HF_HUB_OFFLINE=1" in line and "presets" not in line, line
    assert "datasets.load_dataset('HuggingFaceH4/MATH-500')" in line and "--data_dir DIR" in line, line
    assert ("hf download Qwen/Qwen3-4B" in line) == (model == "Qwen/Qwen3-4B"), line


def test_evals_run_help_lists_only_its_own_flags():
    """evals.run has no presets, recipes or runs to resume: its --help does not offer them, and they are refused."""
    from evals.run import EvalArgs

    parser_help = subprocess.run([sys.executable, "-m", "evals.run", "--help"], cwd=REPO, env=subprocess_env(),
                                 capture_output=True, text=True, timeout=120).stdout
    assert "--model" in parser_help and "--benchmarks" in parser_help
    assert "--config" not in parser_help and "--preset" not in parser_help and "recipe" not in parser_help
    with pytest.raises(SystemExit, match="unknown arguments --preset toy"):
        parse_flags(EvalArgs, ["--model", "m", "--preset", "toy"])


def test_a_system_prompt_without_a_chat_template_is_said_to_be_unused(workdir, capsys):
    """A tokenizer without a chat template: --system_prompt would be dropped without a word."""
    argv = SMALL + ["--model", "bad/plain", "--system_prompt", "Be brief."]
    args = parse_args(importlib.import_module("grpo").Args, argv)
    checks.check_args(args, num_processes=1)
    expected = "--system_prompt is not used: the tokenizer of --model bad/plain has no chat"
    assert expected in capsys.readouterr().err


def test_ignored_settings_warn(workdir, capsys):
    """A setting that would change nothing says so (and the run goes on)."""
    args = parse_args(importlib.import_module("grpo").Args, SMALL + [
        "--use_chat_template", "false", "--system_prompt", "Be brief.",
        "--eval_benchmarks", "toy", "--lora_alpha", "8", "--vllm_tensor_parallel_size", "2", "--rollout_engine", "hf",
        "--mis", "--max_refill_rounds", "9", "--gradient_checkpointing_every", "2"])
    notes = checks.ignored_settings(args)
    assert any("--system_prompt is ignored without the chat template" in n for n in notes)
    assert any("--eval_benchmarks is ignored with --eval_steps 0" in n for n in notes)
    assert any("--lora_alpha is ignored with --lora_r 0" in n for n in notes)
    assert any("--vllm_tensor_parallel_size is ignored with --rollout_engine hf" in n for n in notes)
    assert any("--mis is ignored with --tis_cap 0" in n for n in notes)
    assert any("--max_refill_rounds is ignored without --dynamic_sampling" in n for n in notes)
    assert any("--gradient_checkpointing_every is ignored without --gradient_checkpointing" in n for n in notes)
    assert len(notes) == 7, notes
    # the preset's own values are not the user's: the toy preset alone warns about nothing
    assert checks.ignored_settings(parse_args(importlib.import_module("grpo").Args, SMALL)) == []
    one_file = parse_args(importlib.import_module("grpo").Args, SMALL + ["--eval_steps", "5", "--eval_dataset", ""])
    assert any("eval/accuracy is measured on its first --eval_num_prompts training prompts" in n
               for n in checks.ignored_settings(one_file))


def test_every_row_is_read_and_rows_without_answers_are_counted(workdir, capsys):
    """Past the first rows (the checks read every row, a batch at a time): an empty prompt at row 25,000 is refused,
    answers missing from some rows are counted with the first, and the run goes on."""
    from common.rails.checks import data_problems

    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(25_001)]
    rows[20_000]["answer"], rows[24_000]["answer"] = "", None
    (workdir / "bad" / "big.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems, loaded = data_problems("--dataset", "bad/big.jsonl", None, "train", "prompt", "answer")
    assert problems == [] and len(loaded) == 25_001
    assert ("--dataset 'bad/big.jsonl': 2 of 25001 rows have no answer in --answer_column 'answer' (the first: row "
            "20000); a reward that reads the answer gives them 0") in capsys.readouterr().err
    rows[25_000]["prompt"] = ""
    (workdir / "bad" / "big.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems, _ = data_problems("--dataset", "bad/big.jsonl", None, "train", "prompt", "answer")
    assert problems == ["--dataset 'bad/big.jsonl': 1 of 25001 rows of --prompt_column 'prompt' are not text (the "
                        "first, row 25000, is empty); prompts must be text, or lists of {'role', 'content'} messages"]
    assert data_problems("--dataset", "bad/big.jsonl", None, "train", "prompt", "answer", answers_needed=False)[0]


def test_dropped_prompts_are_counted(workdir, capsys):
    from common.tasks.data import load_prompts

    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "12+34=", "answer": "46"},
            {"prompt": "99+99=", "answer": "198"}]
    (workdir / "bad" / "three.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = load_prompts(build_tokenizer(), "bad/three.jsonl", None, "train", "prompt", "answer", max_prompt_length=4)
    assert kept["prompt"] == ["1+1="]  # "12+34=" and "99+99=" are 6 tokens
    err = capsys.readouterr().err
    assert "2 of the 3 prompts of bad/three.jsonl (66.7%) are longer than --max_prompt_length 4" in err
    with pytest.raises(ValueError, match="All 3 prompts .* are longer than --max_prompt_length 3"):
        load_prompts(build_tokenizer(), "bad/three.jsonl", None, "train", "prompt", "answer", max_prompt_length=3)


# --- runs that break, folders that are taken, resumes that change settings ---------------------------------------


def test_a_nan_loss_stops_the_run_without_saving(workdir, monkeypatch, capsys):
    import grpo

    calls, original = {"n": 0}, grpo.compute_loss

    def nan_on_second_step(*args, **kwargs):
        calls["n"] += 1
        loss, metrics = original(*args, **kwargs)
        if calls["n"] > 4:  # 4 micro-batches a step: from step 2 on, the loss is NaN (and reported as NaN)
            loss = loss * float("nan")
            metrics["loss/policy"] = loss.detach()
        return loss, metrics

    monkeypatch.setattr(grpo, "compute_loss", nan_on_second_step)
    with pytest.raises(SystemExit) as exit_info:
        run_script(grpo, SMALL + ["--total_steps", "3", "--save_steps", "1", "--run_name", "nan"])
    message = exit_info.value.code
    assert message.startswith("error: step 2: loss/policy is nan") and "\n" not in message
    assert "the last good checkpoint is runs/nan/checkpoints/step_1 (--resume_from runs/nan" in message
    assert sorted(os.listdir("runs/nan/checkpoints")) == ["step_1"]  # nothing non-finite written
    weights = load_file("runs/nan/checkpoints/step_1/model/model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert [m["step"] for m in read_metrics("runs/nan")] == [1, 2]  # the broken step's metrics are kept to read


def test_non_finite_weights_are_never_saved(workdir, tmp_path):
    from accelerate import Accelerator

    from common.run_folder.checkpoints import save_checkpoint

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0)
    accelerator = Accelerator(cpu=True)
    save_checkpoint(accelerator, model, tokenizer, str(tmp_path), 1)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")
    with pytest.raises(SystemExit, match=r"step 2: 1 weights are not finite; refusing to save them; the last good "
                                         r"checkpoint is .*step_1"):
        save_checkpoint(accelerator, model, tokenizer, str(tmp_path), 2)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_1"]


def test_a_run_name_is_never_reused(workdir, no_weights_after_first_run, capsys):
    import grpo

    first = no_weights_after_first_run(lambda: run_script(grpo, SMALL + ["--run_name", "taken", "--save_steps", "1"]))
    before = {name: open(os.path.join(first, name)).read() for name in ("metrics.jsonl", "args.json")}
    message = refusal(lambda: run_script(grpo, SMALL + ["--run_name", "taken", "--seed", "2"]), capsys)
    assert message == ("error: the run folder runs/taken is in use (args.json, args_history.jsonl, checkpoints, "
                       "metrics.jsonl); pass another --run_name, continue it with --resume_from runs/taken, or delete "
                       "the folder")
    assert before == {name: open(os.path.join(first, name)).read() for name in ("metrics.jsonl", "args.json")}
    message = refusal(lambda: run_script(grpo, SMALL + ["--run_name", "toy"]), capsys)  # the toy's own folder
    assert "runs/toy is in use" in message and "--resume_from" not in message


@pytest.fixture
def no_weights_after_first_run(monkeypatch):
    """Run `first` normally, then make any later weight loading fail the test."""
    def run(first):
        result = first()
        def refuse(*args, **kwargs):
            raise AssertionError("weights were loaded before the bad input was refused")
        monkeypatch.setattr(transformers.modeling_utils.PreTrainedModel, "from_pretrained", refuse)
        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
        return result
    return run


def test_a_run_folder_in_use_is_locked(workdir, capsys):
    """Another process holds the lock (a run in progress): refused. Once it exits, the lock is gone with it."""
    import gspo

    os.makedirs("runs/busy", exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               "fd = os.open('runs/busy/.lock', os.O_RDWR | os.O_CREAT)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'pid %d' % os.getpid())\n"
                               "print('locked', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        message = refusal(lambda: run_script(gspo, SMALL + ["--run_name", "busy"]), capsys)
        assert message.startswith("error: the run folder runs/busy is locked by a run in progress (pid ")
    finally:
        holder.kill()
        holder.wait()
    run = run_script(gspo, SMALL + ["--run_name", "busy"])  # a stale .lock file (its holder died) is no obstacle
    assert [m["step"] for m in read_metrics(run)] == [1]


@pytest.mark.slow
def test_two_runs_at_once_cannot_share_a_folder(workdir):
    """Two real processes started together on one run name: exactly one runs, the other is refused."""
    env = subprocess_env()
    cmd = [sys.executable, os.path.join(REPO, "snib.py"), *SMALL, "--run_name", "twins"]
    runs = [subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    outcomes = sorted((p.communicate(timeout=600)[1], p.returncode) for p in runs)
    codes = sorted(code for _, code in outcomes)
    assert codes == [0, 1], outcomes
    refused = next(err for err, code in outcomes if code == 1)
    assert "Traceback" not in refused
    assert ("runs/twins is locked by a run in progress" in refused) or ("runs/twins is in use" in refused), refused
    assert [m["step"] for m in read_metrics(os.path.join(workdir, "runs", "twins"))] == [1]


def test_resume_refuses_changed_settings_unless_overridden(workdir, capsys, monkeypatch):
    import ctpo

    argv = SMALL + ["--total_steps", "2", "--save_steps", "1", "--run_name", "resumable"]
    run = run_script(ctpo, argv)
    original = open(os.path.join(run, "args.json")).read()
    loads = {"n": 0}
    real = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def counting(cls, *args, **kwargs):
        loads["n"] += 1
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(counting))
    resume = SMALL + ["--total_steps", "3", "--resume_from", run]
    message = refusal(lambda: run_script(ctpo, resume + ["--batch_size", "32", "--clip_power", "0"]), capsys)
    assert message == (f"error: --resume_from {run}: --batch_size 16 -> 32, --clip_power 0.5 -> 0.0 changed since the "
                       f"run started; a resume continues the same run: pass the run's values, or --resume_overrides "
                       f"batch_size,clip_power to change them anyway, or start a new run")
    assert loads["n"] == 0
    # what may change: more steps of a constant schedule, micro-batching, checkpoint cadence
    run_script(ctpo, resume + ["--micro_batch_size", "8", "--save_steps", "3"])
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3]
    run_script(ctpo, SMALL + ["--total_steps", "4", "--resume_from", run, "--clip_power", "0",
                              "--resume_overrides", "clip_power"])
    assert "resuming runs/resumable with changed --clip_power 0.5 -> 0.0" in capsys.readouterr().err
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4]
    assert open(os.path.join(run, "args.json")).read() == original  # never rewritten
    with open(os.path.join(run, "args_history.jsonl")) as f:
        history = [json.loads(line) for line in f]
    assert [(h["step"], h["args"]["total_steps"], h["args"]["clip_power"]) for h in history] == [
        (0, 2, 0.5), (2, 3, 0.5), (3, 4, 0.0)]
    # the next resume compares with the latest start: clip_power 0 is now the run's value (a flag not given takes
    # it: issue 52, item 3), and the script's default, given, is a change
    message = refusal(lambda: run_script(ctpo, SMALL + ["--total_steps", "5", "--resume_from", run, "--clip_power",
                                                        "0.5"]), capsys)
    assert "--clip_power 0.0 -> 0.5 changed" in message


def test_total_steps_of_a_decaying_schedule_is_a_change(workdir, capsys):
    import p3o

    argv = SMALL + ["--lr_scheduler_type", "linear", "--save_steps", "1", "--run_name", "decaying"]
    run = run_script(p3o, argv)
    message = refusal(lambda: run_script(p3o, argv + ["--total_steps", "2", "--resume_from", run]), capsys)
    assert "--total_steps 1 -> 2 changed" in message


def test_save_total_limit_keeps_the_last_checkpoints(workdir):
    import snib

    run = run_script(snib, SMALL + ["--total_steps", "4", "--save_steps", "1", "--save_total_limit", "2",
                                    "--run_name", "limited"])
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["step_3", "step_4"]
    all_kept = run_script(snib, SMALL + ["--total_steps", "3", "--save_steps", "1", "--run_name", "unlimited"])
    assert sorted(os.listdir(os.path.join(all_kept, "checkpoints"))) == ["step_1", "step_2", "step_3"]


@pytest.mark.slow
def test_two_processes_stop_together_on_bad_input(workdir):
    """Under accelerate launch, the main process checks and every process gets its verdict: none hangs."""
    env = subprocess_env()
    # torchrun starts both processes (accelerate launch --cpu --num_processes 2 would start one: conftest.launch)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              os.path.join(REPO, "grpo.py"), *SMALL]
    for flags, message in [(["--dataset", "bad/ints.jsonl"], "prompts must be text"),
                           (["--run_name", "toy"], "runs/toy is in use")]:
        done = run_bounded(launch + flags, 300, cwd=workdir, env=env)
        assert done.returncode != 0 and message in done.stderr, done.stderr[-3000:]


def test_lora_under_fsdp_is_refused_before_any_weights_load(workdir, no_weights, capsys, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what accelerate launch --config_file fsdp2.yaml sets
    message = refusal(lambda: run_script(importlib.import_module("grpo"), SMALL + ["--lora_r", "4"]), capsys)
    assert "--lora_r 4 with FSDP is not supported" in message and "ddp.yaml" in message


def test_a_wrong_type_is_one_line_without_the_usage(tmp_path):
    """`--total_steps ten`: one line naming the flag, the value and the type, exit 1; not argparse's usage dump."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "grpo.py"), "--total_steps", "ten"], cwd=tmp_path,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 1 and proc.stdout == "", (proc.returncode, proc.stdout)
    assert proc.stderr.strip() == ("error: argument --total_steps: invalid int value: 'ten'; --help lists the flags")


@pytest.mark.parametrize("flags, expected", [
    (["--beta", "-1"], "error: --beta -1"),
    (["--resume_from", "runs/nothere"], "error: --resume_from 'runs/nothere': no such directory"),
    (["--dataset", "gsm8k"], "error: the hub (http://127.0.0.1:9) cannot be reached from here"),
])
def test_a_wrong_flag_with_a_preset_is_refused_before_the_preset_builds_anything(tmp_path, flags, expected):
    """`--preset toy --beta -1` (or a mistyped run folder to resume, or a hub data set with no hub: a closed port
    stands in for it) in a folder without the toy: refused in one line before the toy's build starts (it printed
    nothing for a minute or more while the build ran, then refused)."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "grpo.py"), "--preset", "toy", *flags],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO, "TOY_CACHE": "", "HF_ENDPOINT": "http://127.0.0.1:9",
                               "HF_HUB_OFFLINE": "0"})
    assert proc.returncode == 1 and "toy: building" not in proc.stdout, proc.stdout[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(expected), proc.stderr[-2000:]
    assert not os.path.exists(tmp_path / "runs")


def test_help_describes_the_script_and_lists_every_flag_and_preset(capsys):
    """--help: the script's one-line description, --config, every preset, and `--no_X` twins in their own words."""
    import grpo
    from common.args import PRESET_NAMES

    with pytest.raises(SystemExit) as e:
        parse_args(grpo.Args, ["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert grpo.__doc__.splitlines()[0] in text
    assert "--config FILE.yaml a YAML recipe of Args fields" in text
    assert all(name in text.split("--preset NAME ")[-1][:200] for name in PRESET_NAMES), text
    assert "(default: the preset's, else train) --eval_dataset" in text  # one default, not two
    assert "--no_use_chat_template turn --use_chat_template off --enable_thinking" in text


HEADINGS = ["options", "the estimator ({}.py's own flags)", "model, data and rewards", "rollouts",
            "optimisation", "run and logging", "advanced"]


def help_text(script: str, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(importlib.import_module(script).Args, [*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("script", ALGORITHMS)
def test_help_lists_each_flag_once_under_headings_in_the_order_of_use(script, capsys):
    """Issue 68, item 2: each flag once (it was printed twice, snake_case and kebab-case), under
    headings: the estimator's own flags first, then the model, data and rewards, rollouts,
    optimisation, run and logging, and the rest under advanced; every field is in one of them."""
    Args = importlib.import_module(script).Args
    text = help_text(script, [], capsys)
    headings = [h.format(script) for h in HEADINGS]
    # a heading is a line of its own ending with ":"
    found = [line[:-1] for line in text.splitlines() if line.endswith(":") and line[0] != " "]
    assert found == headings, found
    entries = re.findall(r"^  (?:-h, )?(--\w[\w-]*)", text, re.MULTILINE)
    assert not [e for e in entries if "-" in e[2:]], entries  # no kebab-case twin
    fields = Args.__dataclass_fields__
    flags = [e for e in entries if not (e.startswith("--no_") and e[5:] in fields)]
    assert sorted(flags) == sorted(f"--{f}" for f in [*Args.__dataclass_fields__, "help", "config"])
    own = text.split(headings[1] + ":")[1].split(headings[2] + ":")[0]
    # the script's own fields and the TrainArgs field it sets again (beta), in the order its Args declares them
    added = [f for f in Args.__annotations__ if f != "exp_name"]
    listed = re.findall(r"^  --(\w+)", own, re.MULTILINE)
    assert [f for f in listed if not (f.startswith("no_") and f[3:] in added)] == added


def test_help_shows_the_first_flags_on_its_first_screen_and_a_preset_s_values(capsys):
    """Issue 68, item 2: the flags a user changes first are on the first screen (24 lines); with
    --preset, each flag it changes shows the preset's value beside the default."""
    text = help_text("grpo", [], capsys)
    first_screen = "\n".join(text.splitlines()[:24])
    for flag in ("--preset", "--model", "--dataset", "--reward_funcs", "--learning_rate",
                 "--total_steps", "--beta"):
        assert flag in first_screen, flag
    assert "--preset toy:" not in text
    text = " ".join(help_text("grpo", ["--preset", "toy"], capsys).split())
    assert "AdamW learning rate (default: 1e-06; --preset toy: 0.0005)" in text, text
    assert "(default: 0.04)" in text  # --beta: the toy preset leaves it


@pytest.mark.parametrize("where", ["ref_logp", "sampler_logp", "logp"])
def test_a_non_finite_log_prob_is_named_by_the_metrics_it_breaks(workdir, monkeypatch, where):
    """Issue 55: NaN in policy/kl or the log-prob gap at step 1 of bf16 runs. A NaN in the sampler's log-probs was
    blamed on a failed weight push (the gap check), one in the reference's was "loss/policy is nan". Now the stop
    names every non-finite metric, which says whose log-probs broke (docs/notes.md): the sampler's, the gap alone;
    the reference's, policy/kl and the loss; the trainer's, all of them."""
    import grpo

    original, completion_logprobs = grpo.old_and_reference_logprobs, grpo.completion_logprobs

    def poisoned(run, batch, metrics):
        old_logp, ref_logp = original(run, batch, metrics)
        if where != "logp":
            (ref_logp if where == "ref_logp" else batch.sampler_logp)[0, 0] = float("nan")
        return old_logp, ref_logp

    def poisoned_update(*args, **kwargs):  # the update's own log-probs, old_logp on-policy
        logp, entropy = completion_logprobs(*args, **kwargs)
        return (logp * float("nan") if where == "logp" else logp), entropy

    monkeypatch.setattr(grpo, "old_and_reference_logprobs", poisoned)
    monkeypatch.setattr(grpo, "completion_logprobs", poisoned_update)
    with pytest.raises(SystemExit) as exit_info:
        run_script(grpo, SMALL + ["--beta", "0.04", "--run_name", f"nan_{where}"])
    names = {"sampler_logp": "rollout/logp_gap_mean is nan",
             "ref_logp": "loss/policy is nan, policy/kl is nan, optim/grad_norm is nan",
             "logp": "rollout/logp_gap_mean is nan, loss/policy is nan, policy/kl is nan, optim/grad_norm is "
                     "nan"}[where]
    assert exit_info.value.code == (f"error: step 1: {names}; training broke and stopped without saving these "
                                    f"weights; no checkpoint was saved before it (see --save_steps)")
    assert not os.path.exists(f"runs/nan_{where}/checkpoints")


def test_a_run_folder_alone_resumes_with_the_run_s_settings(workdir):
    """Issue 52, item 3: `--resume_from runs/X --total_steps 3` and nothing else takes every other setting from the
    run (its args_history.jsonl, else args.json): not the defaults (Qwen3-4B, gsm8k)."""
    grpo = importlib.import_module("grpo")
    run = run_script(grpo, SMALL + ["--total_steps", "2", "--save_steps", "1", "--run_name", "alone", "--seed", "3",
                                    "--reward_funcs", "toy_closeness"])
    for path in (run, os.path.join(run, "checkpoints", "step_1")):  # a run folder, or one of its checkpoints
        args = parse_args(grpo.Args, ["--resume_from", path, "--total_steps", "3"])
        assert (args.model, args.seed, args.reward_funcs, args.batch_size) == ("runs/toy/model", 3, "toy_closeness",
                                                                             16), args
    assert run_script(grpo, ["--resume_from", run, "--total_steps", "3"]) == run
    assert [m["step"] for m in read_metrics(run) if "reward/mean" in m] == [1, 2, 3]
    with open(os.path.join(run, "args_history.jsonl")) as f:
        first, resumed = [json.loads(line) for line in f]
    assert resumed["step"] == 2
    assert {k for k in first["args"] if first["args"][k] != resumed["args"][k]} == {"total_steps", "resume_from"}


@pytest.mark.parametrize("argv, stops", [
    ([], True),
    (["--total_steps", "3", "--dataset", "gsm8k"], True),
    (["--model", "Qwen/Qwen3-4B"], False),  # the default, asked for
    (["--model=runs/toy/model"], False),
    (["--preset", "smollm2"], False),
    (["--config", os.path.join(REPO, "configs", "recipes", "grpo_qwen3_4b_numina.yaml")], False),  # names its model
    (["--help"], None),
])
def test_the_default_model_on_a_machine_without_a_gpu_names_the_cpu_presets(monkeypatch, argv, stops):
    """Issue 52, item 4: `python grpo.py` (the command line, no --preset, no --model) on a machine without CUDA stops
    in one line naming the presets that run on a CPU, before anything loads; with a GPU it goes on."""
    import torch

    grpo = importlib.import_module("grpo")
    monkeypatch.setattr(sys, "argv", ["grpo.py", *argv])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if stops is None:  # --help prints the flags and exits 0
        with pytest.raises(SystemExit) as info:
            parse_args(grpo.Args)
        assert info.value.code == 0
        return
    if stops:
        with pytest.raises(SystemExit) as info:
            parse_args(grpo.Args)
        assert info.value.code == ("error: no GPU here (CUDA is not available) for the default --model "
                                   "Qwen/Qwen3-4B: pass --preset with one that runs on a CPU (toy, toy_tir, smollm2), "
                                   "or --model to run a model of your choice anyway")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert parse_args(grpo.Args).exp_name == "grpo"  # with a GPU, or asked for: no stop
    assert parse_args(grpo.Args, argv).exp_name == "grpo"  # argv given (a test, a program): no guard
