"""The checks of ``verl train --check`` that need the trainer's libraries, which the daemon must not
import: ``python -m trainer.check --config RESOLVED.yaml``.

Loads what is cheap to load and builds no model: the tokenizers, every data file (each row as the
trainer reads it), each model directory's config.json and the multi-turn rollout's tools and interactions (each
class imported and built with its config, its schema checked), then checks every prompt's length against
data.max_prompt_length as the trainer does at start (trainer/data/checks.py). Prints one ``ERROR:`` line
per problem and exits 2, or exits 0 with nothing printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from trainer.config import BUILTIN_PREFIX, KEYS, ConfigError, RunConfig, load_config
from trainer.config.exit_codes import EXIT_OK, EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.check", description="Check a run's data and models.")
    parser.add_argument("--config", required=True, help="YAML run config (resolved, as `verl train` writes it)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as error:
        return _report([str(problem) for problem in error.problems])
    return _report(check_run(config))


def check_run(config: RunConfig) -> list[str]:
    """One line per problem with the run's tokenizers, data files and model directories."""
    from trainer.data.checks import check_prompts, drop_overlong_prompts
    from trainer.data.user_classes import prompt_sampler, read_records
    from trainer.errors import UserError
    from trainer.models.loading import load_tokenizer
    from trainer.models.vision_language import prompts_as_seen
    from trainer.rollout.tools import tool_problems

    problems: list[str] = []
    model, data = config.actor_rollout_ref.model, config.data
    source = model.tokenizer_path or model.path
    tokenizer = None
    try:
        tokenizer = load_tokenizer(source, trust_remote_code=model.trust_remote_code,
                                   chat_template=model.custom_chat_template)
        if config.reward_model.enable:
            network = config.reward_model.model
            load_tokenizer(network.tokenizer_path or network.path, trust_remote_code=network.trust_remote_code,
                           setting=KEYS.reward_model.model.tokenizer_path)
    except UserError as error:
        problems.append(str(error))
    seen = None  # a vision-language model's prompts count their images' tokens
    if tokenizer is not None:
        try:
            seen = prompts_as_seen(model.path, tokenizer)
        except UserError as error:
            problems.append(str(error))
    problems += _unreadable_model_configs(config)
    problems += tool_problems(config)  # the multi-turn rollout's tools and interactions, built
    # The built-in rule scorers compare each response with the row's ground truth (as the trainer loads them).
    builtin_scoring = not config.reward_model.enable and config.custom_reward_function.path is None
    for files_key, files in ((KEYS.data.train_files, data.train_files), (KEYS.data.val_files, data.val_files)):
        try:
            if tokenizer is None and data.custom_cls.path is not None:
                continue  # the dataset class is given the tokenizer, whose problem is said above
            records = read_records(config, files, tokenizer, require_ground_truth=builtin_scoring)
            if files_key == KEYS.data.train_files and data.sampler.class_path is not None:
                prompt_sampler(config, records)
            if tokenizer is not None and data.filter_overlong_prompts:
                records = drop_overlong_prompts(records, tokenizer, data.max_prompt_length,
                                                data.apply_chat_template_kwargs, seen)
                if files and not records:
                    problems.append(f"{files_key}: every prompt is longer than {KEYS.data.max_prompt_length}="
                                    f"{data.max_prompt_length} tokens ({KEYS.data.filter_overlong_prompts} drops "
                                    "them); raise it")
                    continue
            if tokenizer is not None:
                name = (f"{source}'s built-in {len(tokenizer)}-token tokenizer" if source.startswith(BUILTIN_PREFIX)
                        else repr(source))
                check_prompts(records, tokenizer, files_key=files_key, max_length=data.max_prompt_length,
                              truncation=data.truncation, tokenizer_setting=KEYS.actor_rollout_ref.model.tokenizer_path,
                              tokenizer_name=name, template_kwargs=data.apply_chat_template_kwargs, seen=seen)
        except UserError as error:
            problems.append(str(error))
    return problems


def _unreadable_model_configs(config: RunConfig) -> list[str]:
    """The config.json of each model directory the run builds, read as JSON (the schema saw that it exists); a GGUF
    file's header, tensors and architecture (trainer/models/gguf.py)."""
    from trainer.models.gguf import GGUFError, check_gguf_file, is_gguf

    paths = [(KEYS.actor_rollout_ref.model.path, config.actor_rollout_ref.model.path)]
    if config.use_critic:
        paths.append((KEYS.critic.model.path, config.critic.model.path))
    if config.reward_model.enable:
        paths.append((KEYS.reward_model.model.path, config.reward_model.model.path))
    problems = []
    for key, path in paths:
        if path is None or path.startswith(BUILTIN_PREFIX):
            continue
        if is_gguf(path):  # its config is in the file's metadata: the file's own check reads that
            try:
                check_gguf_file(Path(path).expanduser(), key)
            except GGUFError as error:
                problems.append(str(error))
            continue
        file = Path(path).expanduser() / "config.json"
        try:
            json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            problems.append(f"{key}: {str(file)!r} cannot be read as JSON ({error}); allowed: a model directory "
                            "written by save_pretrained")
    return problems


def _report(problems: list[str]) -> int:
    for problem in problems:
        print(f"ERROR: {problem}", file=sys.stderr)
    return EXIT_USAGE if problems else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
