"""`--help` of a training script, imported only when it is asked for (common/args.py parse_args):
the flags under headings in the order a user changes things, each flag once, and the values a
--preset gives."""

import argparse
import copy
import dataclasses

# Headings after the estimator's own flags, each with its flags in the order they are changed; a
# field named nowhere here is listed under "advanced", in the order of its dataclass.
GROUPS = {
    "model, data and rewards": [
        "model", "dataset", "reward_funcs", "reward_weights", "dataset_config", "split",
        "eval_dataset", "eval_split", "prompt_column", "answer_column", "prompt_template",
        "system_prompt", "use_chat_template", "enable_thinking",
    ],
    "rollouts": [
        "num_generations", "max_completion_length", "max_prompt_length", "temperature", "top_p",
        "rollout_engine", "server_url",
    ],
    "optimisation": [
        "learning_rate", "total_steps", "batch_size", "mini_batch_size", "micro_batch_size",
        "num_iterations", "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm",
        "dtype", "gradient_checkpointing", "lora_r", "lora_alpha", "lora_target_modules",
    ],
    "run and logging": [
        "output_dir", "run_name", "exp_name", "seed", "report_to", "eval_steps",
        "eval_num_prompts", "eval_benchmarks", "eval_num_samples", "save_steps",
        "save_total_limit", "resume_from", "resume_overrides",
    ],
}  # fmt: skip
# first, the flags most runs set; --preset and --config stay at the top, under "options"
USAGE = ("%(prog)s [--preset NAME | --model M --dataset D --reward_funcs F]\n"
         "       [--learning_rate X] [--total_steps N] [--config FILE.yaml] [--FLAG VALUE ...]")
TOP = ("help", "preset", "config")


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag once (not its kebab-case twin), with a metavar that says its type (N, X, TEXT,
    BOOL) rather than its name again."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=36)

    def _format_action_invocation(self, action):
        twins = [s for s in action.option_strings if s.startswith("--") and "-" in s[2:]]
        if twins:  # --total-steps beside --total_steps
            action = copy.copy(action)
            action.option_strings = [s for s in action.option_strings if s not in twins]
        return super()._format_action_invocation(action)

    def _get_default_metavar_for_optional(self, action):
        names = {int: "N", float: "X", str: "TEXT"}
        return names.get(action.type, "BOOL" if action.nargs == "?" else "TEXT")


def arrange(parser: argparse.ArgumentParser, args_cls, base_cls, preset: str | None,
            preset_values: dict) -> None:
    """Move the parser's flags under GROUPS' headings, the estimator's own (the fields `args_cls`
    declares itself, beta among them) first; show what `--preset` sets beside each flag it
    changes."""
    parser.formatter_class = Formatter
    parser.usage = USAGE
    # the script's own flags, in the order its Args declares them, and those of TrainArgs it sets
    # again (beta: its own default and help)
    scripts = [c for c in reversed(args_cls.__mro__)
               if issubclass(c, base_cls) and c is not base_cls]
    declared = [name for c in scripts for name in vars(c).get("__annotations__", {})]
    own = [name for name in dict.fromkeys(declared) if name != "exp_name"]
    fields = [f.name for f in dataclasses.fields(args_cls)]
    listed = {name for names in GROUPS.values() for name in names}
    script = args_cls.__dataclass_fields__["exp_name"].default  # its file's name
    headings = {f"the estimator ({script}.py's own flags)": own, **GROUPS,
                "advanced": [f for f in fields if f not in listed and f not in own + list(TOP)]}
    for action in parser._optionals._group_actions:
        action.metavar = {"preset": "NAME", "config": "FILE.yaml"}.get(action.dest, action.metavar)
        default = getattr(args_cls.__dataclass_fields__.get(action.dest), "default", None)
        if (action.dest in preset_values and preset_values[action.dest] != default
                and not action.option_strings[0].startswith("--no_")):
            action.help = (f"{action.help} (default: {default}; --preset {preset}: "
                           f"%(default)s)")
    for title, names in headings.items():
        group = parser.add_argument_group(title)
        for name in names:
            for action in [a for a in parser._optionals._group_actions if a.dest == name]:
                parser._optionals._group_actions.remove(action)
                group._group_actions.append(action)
