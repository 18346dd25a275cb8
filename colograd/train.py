"""Train a model with GRPO from a YAML recipe; command-line flags override the recipe's keys.

accelerate launch colograd/train.py --config recipes/grpo_qwen.yaml --max_steps 10
python colograd/train.py --config recipes/grpo_tiny.yaml          # one process
"""

import dataclasses
import os
import re
import sys
import time
import traceback
import typing
from typing import Any, NoReturn

# Importing transformers creates cache folders (TorchInductor's): a cache variable that names a file fails there,
# before any of colograd's checks can run, so that failure is put in one line here.
try:
    import torch
    from huggingface_hub.errors import StrictDataclassError
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        PretrainedConfig,
        PreTrainedModel,
        PreTrainedTokenizerBase,
    )
    from trl import ModelConfig, TrlParser, get_peft_config

    from colograd import GRPOConfig, GRPOTrainer, ScriptArguments
    from colograd.config.core import COMMON_FIELDS, TOPICS, ConfigError
    from colograd.config.loading import model_init_kwargs, tokenizer_kwargs
    from colograd.config.ranges import check_ranges
    from colograd.config.recipe import check_recipe_value, read_recipe
    from colograd.config.trl_compat import DROPPED_KEYS, RENAMED_KEYS, unknown_key_message
    from colograd.data.core import first_line
    from colograd.errors import SaidBefore
    from colograd.grpo.policy import use_chat_template
    from colograd.models import model_files, pretrained, tiny, tiny_vlm
    from colograd.preflight.core import preflight
    from colograd.preflight.env import check_environment, check_variables
    from colograd.runs.modelcard import Recipe
    from colograd.runs.output_dir import RunFinished, check_output_dir, finish_from_checkpoint
    from colograd.runs.preemption import PREEMPTED_EXIT_CODE, StepFailure, exit_interrupted
    from colograd.runs.process_exit import run_then_exit
    from colograd.runs.saving import push_output_dir
    from colograd.vision.core import load_pretrained, text_tokenizer
except OSError as err:
    if err.filename is None:  # not a path (a library that cannot load): its own traceback says more
        raise
    failed = os.path.abspath(str(err.filename)) + os.sep
    # The variable naming that folder, or the closest folder above it (TORCHINDUCTOR_CACHE_DIR before HOME).
    paths = {k: os.path.abspath(v) + os.sep for k, v in os.environ.items() if v[:1] == os.sep and os.pathsep not in v}
    named = max((k for k, path in paths.items() if failed.startswith(path)), key=lambda k: len(paths[k]), default=None)
    where = f"{named}={os.environ[named]}" if named else err.filename
    print(f"colograd: error: importing torch / transformers failed at {where}: {err.strerror}; point it at a "
          "folder this user can create and write.", file=sys.stderr)  # fmt: skip
    sys.exit(2)


def load_model_config(
    args: ModelConfig, training_args: GRPOConfig
) -> tuple[PretrainedConfig, PreTrainedTokenizerBase, torch.dtype]:
    """The policy's config, tokenizer (with the recipe's `chat_template`, if any) and the dtype its weights will have,
    without reading the weights."""
    config, tokenizer, dtype = _model_config(args, training_args)
    return config, use_chat_template(tokenizer, training_args.chat_template), dtype


def _model_config(
    args: ModelConfig, training_args: GRPOConfig
) -> tuple[PretrainedConfig, PreTrainedTokenizerBase, torch.dtype]:
    """`load_model_config`, before the recipe's chat template."""
    if args.model_name_or_path is None:
        raise ConfigError("model_name_or_path is not set; give a hub id, a local folder or colograd:tiny-qwen2.")
    name = _folder(args.model_name_or_path)
    if name == tiny_vlm.TINY_VLM:  # the tiny LLaVA: its processor stands for the tokenizer
        # Its config alone: a model built on the meta device runs the vision tower's initialisation, which fails
        # there under ZeRO-3 (transformers initialises through DeepSpeed's gather, and a meta buffer has no data).
        return tiny_vlm.model_config(), tiny_vlm.build_processor(), torch.float32
    if name.startswith(tiny.PREFIX):
        if name not in tiny.TINY_MODELS:
            built_in = ", ".join([*tiny.TINY_MODELS, tiny_vlm.TINY_VLM, *pretrained.MODELS])
            raise ConfigError(f"model_name_or_path={name!r}: the built-in models are {built_in}.")
        with model_files.on_meta_device():  # the architecture only: no memory, no initialisation
            model = tiny.build_model(tie_word_embeddings=tiny.TINY_MODELS[name])
        return model.config, tiny.build_tokenizer(), model.dtype
    if name.startswith((".", "/")) and not os.path.isdir(name):
        raise ConfigError(f"model_name_or_path={name!r} does not exist; give an existing folder or a hub id.")
    local = os.path.isdir(name)
    if local:  # its files, before transformers reads them (`colograd.models.model_files`)
        model_files.check_model_folder(name, training_args.trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(name, **_hub_kwargs(args, training_args))
    except (OSError, ValueError, StrictDataclassError) as err:  # no folder, no reachable hub id, a bad config
        raise ConfigError(f"model_name_or_path={name!r} cannot be loaded: {first_line(err)}") from err
    try:  # a vision-language model's processor (its tokenizer and image processor), as GRPOTrainer loads it
        tokenizer = load_pretrained(
            name, AutoTokenizer, **_hub_kwargs(args, training_args) | tokenizer_kwargs(training_args)
        )
    except Exception as err:  # the tokenizers library raises a bare Exception for a tokenizer.json it cannot use
        raise ConfigError(
            f"model_name_or_path={name!r}: its tokenizer cannot be loaded ({first_line(err)}); restore "
            "tokenizer.json and tokenizer_config.json from where the model came from."
        ) from err
    model_files.check_special_tokens(
        name,
        text_tokenizer(tokenizer),
        _eos_token_id(name, config, args, training_args),
        getattr(config.get_text_config(), "vocab_size", None),
        model_files.saved_tokens(name) if local else None,
    )
    if local:  # the weights' headers against the config's model: nothing is read but the headers
        model_files.check_weight_files(name, config, training_args.trust_remote_code, required=False)
    dtype = getattr(torch, args.dtype) if args.dtype not in (None, "auto") else getattr(config, "dtype", None)
    return config, tokenizer, dtype or torch.float32


def _eos_token_id(name: str, config: PretrainedConfig, args: ModelConfig, training_args: GRPOConfig) -> Any:
    """The model's end-of-sequence id(s), where the engine reads them: generation_config.json, else config.json."""
    try:
        generation = GenerationConfig.from_pretrained(name, **_hub_kwargs(args, training_args))
    except OSError:  # none saved: transformers derives one from config.json
        generation = None
    found = generation.eos_token_id if generation is not None else None
    return found if found is not None else getattr(config.get_text_config(), "eos_token_id", None)


def load_model(args: ModelConfig, training_args: GRPOConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The policy and its tokenizer: a built-in tiny model, a built-in pretrained one (converted once into a
    local folder), a local folder, or a hub id.

    The lengths are checked against the model's config before its weights are read.
    """
    name = args.model_name_or_path
    config, tokenizer, _ = load_model_config(args, training_args)
    name = _folder(name)
    training_args.check_lengths(config)
    if name == tiny_vlm.TINY_VLM:
        return tiny_vlm.build_model(), tokenizer
    if name.startswith(tiny.PREFIX):
        return tiny.build_model(tie_word_embeddings=tiny.TINY_MODELS[name]), tokenizer
    if os.path.isdir(name):  # weights present (their headers and shapes were checked with the config)
        model_files.check_weight_files(name, None)
    dtype = args.dtype if args.dtype in (None, "auto") else getattr(torch, args.dtype)
    model_kwargs = {"dtype": dtype, "attn_implementation": args.attn_implementation}
    try:
        # A vision-language model (its config has a vision part) loads as an image-text-to-text model.
        model = load_pretrained(
            name,
            AutoModelForCausalLM,
            **_hub_kwargs(args, training_args) | model_kwargs | model_init_kwargs(training_args),
        )
    except torch.OutOfMemoryError:
        raise
    except (OSError, RuntimeError, ValueError) as err:  # what the checks above cannot see: names renamed on load
        raise ConfigError(
            f"model_name_or_path={name!r}: its weights cannot be loaded ({first_line(err)}); use the config.json "
            "the weights were saved with, or copy the weights again."
        ) from err
    return model, tokenizer


def _folder(name: str) -> str:
    """Where a built-in pretrained model is (converted into the cache on first use); other names as they are."""
    return pretrained.materialise(name) if name in pretrained.MODELS else name


def _hub_kwargs(args: ModelConfig, training_args: GRPOConfig) -> dict[str, Any]:
    """What every `from_pretrained` of the policy is given: the revision, and whether to run the repo's code."""
    return {"revision": args.model_revision, "trust_remote_code": training_args.trust_remote_code}


def check_supported(model_args: ModelConfig) -> None:
    """Refuse options this version does not implement, rather than ignore them."""
    if model_args.load_in_4bit or model_args.load_in_8bit:
        raise ConfigError("load_in_4bit / load_in_8bit: quantized training is not supported; remove the flag.")


def main(
    script_args: ScriptArguments, training_args: GRPOConfig, model_args: ModelConfig, recipe: Recipe | None = None
) -> None:
    """Check every input (`colograd.preflight.core`), load, train, save (with the model card) and, with `push_to_hub`,
    upload. A run stopped by SIGTERM exits with `PREEMPTED_EXIT_CODE` after its checkpoint."""
    check_supported(model_args)
    model_name, revision = model_args.model_name_or_path, model_args.model_revision
    check_environment(training_args, model_name, script_args.dataset_name, revision)  # before anything is loaded
    # Before anything slow (a download, a conversion): a second run on this output_dir stops here.
    try:
        check_output_dir(training_args, training_args.resume_from_checkpoint)
    except RunFinished as done:  # the last step is saved, the final model is not: it is the checkpoint's
        finish_from_checkpoint(done, training_args)
        if training_args.push_to_hub and training_args.process_index == 0:
            print(f"colograd: note: pushed {done.output_dir} to {push_output_dir(training_args)}.", file=sys.stderr)
        return
    config, tokenizer, dtype = load_model_config(model_args, training_args)
    adapter_rank = model_args.lora_r if model_args.use_peft and training_args.lora_sync == "adapter" else None
    peft_config = get_peft_config(model_args)
    inputs = preflight(script_args, training_args, config, text_tokenizer(tokenizer), dtype, peft_config, adapter_rank)
    model, tokenizer = load_model(model_args, training_args)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=inputs.reward_funcs,
        args=training_args,
        train_dataset=inputs.dataset,
        eval_dataset=inputs.eval_dataset,
        processing_class=tokenizer,
        peft_config=peft_config,  # the trainer wraps the model, as for a Python caller
        recipe=recipe,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if trainer.preemption.requested:
        sys.exit(PREEMPTED_EXIT_CODE)
    trainer.save_model(training_args.output_dir)  # writes README.md, the model card, beside the weights
    if training_args.push_to_hub:
        trainer.push_to_hub()


def cli(argv: list[str] | None = None) -> None:
    """Parse, then run; configuration mistakes end in one line on stderr and exit code 2, a failure during
    training in one line naming its step and stage and exit code 1. `--debug` (or COLOGRAD_DEBUG=1) adds the
    traceback."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv or os.environ.get("COLOGRAD_DEBUG", "0") not in ("", "0")
    argv = [arg for arg in argv if arg != "--debug"]
    parser = _Parser((ScriptArguments, GRPOConfig, ModelConfig))
    try:
        check_variables()  # before parsing, which reads the launch variables (LOCAL_RANK, ...)
        # Parsing raises ValueError for unknown recipe keys and for values the dataclasses reject.
        script_args, training_args, model_args = parser.parse_args_and_config(argv)
    except ValueError as err:
        _fail(err, debug=debug)
    recipe = Recipe.from_argv(argv, model_args.model_name_or_path, script_args.dataset_name)
    try:
        main(script_args, training_args, model_args, recipe)
    except ConfigError as err:
        _fail(err, debug=debug)
    except StepFailure as err:
        _fail(err, code=1, debug=debug)
    except KeyboardInterrupt as err:  # Ctrl-C: one line naming the step and stage, exit code 130
        exit_interrupted(err, training_args.output_dir, debug)


class _Parser(TrlParser):
    """TRL's parser, but a bad flag or value (`--num_generations eight`) ends in one line, not the full usage; an
    unknown key is named with the closest known one; a key transformers 5 renamed is read as its new name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Several trackers on the command line, as a recipe lists them: --report_to wandb trackio.
        self._option_string_actions["--report_to"].nargs = "+"
        # argparse takes "-1e-5" for a flag (it knows only -1 and -.5 as numbers): --learning_rate -1e-5 would
        # end in "expected one argument" instead of reaching the range check.
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
        self._recipe_path = ""
        # argparse's usage would list every field (200 lines) before the help: say how the command is used instead.
        self.usage = "%(prog)s [--config RECIPE.yaml] [--FIELD VALUE ...] [--debug]"
        self.description = (
            "Train with GRPO. --config reads a YAML recipe of FIELD: VALUE keys (see recipes/); flags override them; "
            "--debug adds the traceback to an error. The fields follow, by topic."
        )
        self._group_help()
        self._fields = {
            f.name: (hints[f.name], _default(f))
            for cls in self.dataclass_types
            for hints in [typing.get_type_hints(cls)]
            for f in dataclasses.fields(cls)
        }

    def _group_help(self) -> None:
        """`--help` by topic (`colograd.config.core.TOPICS`): the fields people set first, TRL's refused ones last."""
        topic = _topics()
        common = "Most used"
        groups = {title: self.add_argument_group(title) for title in [common, *(title for title, _ in TOPICS)]}
        ungrouped = []
        for action in self._optionals._group_actions:
            # argparse formats help with %: a bare one ("saves 20% of") broke --help; transformers' write %%.
            action.help = action.help and re.sub(r"%%|%\(\w+\)\w|%", _escape_percent, action.help)
            title = common if action.dest in COMMON_FIELDS else topic.get(action.dest)
            (groups[title]._group_actions if title else ungrouped).append(action)
        self._optionals._group_actions = ungrouped  # -h, and any field of a class TOPICS does not list
        groups[common]._group_actions.sort(key=lambda action: COMMON_FIELDS.index(action.dest))

    def error(self, message: str) -> NoReturn:
        _fail(message)

    def parse_args_and_config(self, args: list[str] | None = None, **kwargs: Any) -> tuple:
        args = list(sys.argv[1:] if args is None else args)
        for i, arg in enumerate(args):
            name, sep, value = arg.removeprefix("--").partition("=")
            if arg.startswith("--") and name in RENAMED_KEYS:
                args[i] = f"--{_renamed(name)}{sep}{value}"
        path, args = _config_path(args)
        if path is not None:  # read here, not by TRL's parser: every mistake in the file becomes one line
            recipe = read_recipe(path)
            _set_environment(path, recipe.pop("env", {}))
            self._recipe_path = path
            self.set_defaults_with_config(**recipe)
        outputs = super().parse_args_and_config(args, **kwargs)
        for output in outputs:
            if not isinstance(output, GRPOConfig):  # GRPOConfig checks its own ranges when built
                check_ranges(output)
        return outputs

    def set_defaults_with_config(self, **kwargs: Any) -> list[str]:
        for key in DROPPED_KEYS.keys() & kwargs.keys():
            print(f"colograd: note: {key} ignored: {DROPPED_KEYS[key]}.", file=sys.stderr)
            del kwargs[key]
        kwargs = {_renamed(key) if key in RENAMED_KEYS else key: value for key, value in kwargs.items()}
        known = {action.dest for action in self._actions}
        for key in kwargs:
            if key not in known:
                raise ValueError(unknown_key_message(key, sorted(known)))
        for key, value in kwargs.items():
            if key in self._fields:
                kwargs[key] = check_recipe_value(self._recipe_path or "recipe", key, value, *self._fields[key])
        return super().set_defaults_with_config(**kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[Any, list[str]]:
        # Checked here, before the dataclasses are built (and validated), so the unknown flag is what is reported.
        namespace, remaining = super().parse_known_args(args, namespace)
        flags = [arg for arg in remaining if arg.startswith("--")]
        if flags:
            known = sorted(action.dest for action in self._actions)
            raise ValueError(unknown_key_message(flags[0].removeprefix("--").partition("=")[0], known))
        return namespace, remaining


def _escape_percent(match: re.Match) -> str:
    """A help text's bare % doubled; %% and %(default)s kept."""
    return "%%" if match.group(0) == "%" else match.group(0)


def _topics() -> dict[str, str]:
    """Each field's topic title: that of the smallest class in `TOPICS` that has it (GRPOConfig has every mixin's
    field, so it is the topic of TrainingArguments' fields only)."""
    topic: dict[str, tuple[int, str]] = {}
    for title, cls in TOPICS:
        names = [f.name for f in dataclasses.fields(cls)]
        for name in names:
            if name not in topic or len(names) < topic[name][0]:
                topic[name] = (len(names), title)
    return {name: title for name, (_, title) in topic.items()}


def _config_path(args: list[str]) -> tuple[str | None, list[str]]:
    """The recipe named by `--config PATH` or `--config=PATH`, and the other arguments."""
    for i, arg in enumerate(args):
        if arg == "--config":
            if i + 1 == len(args) or args[i + 1].startswith("--"):
                raise ConfigError(
                    "--config needs a value: the path of a YAML recipe, e.g. --config recipes/grpo_tiny.yaml."
                )
            return args[i + 1], args[:i] + args[i + 2 :]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1], args[:i] + args[i + 1 :]
    return None, args


def _set_environment(path: str, env: Any) -> None:
    """A recipe's `env:` mapping, set as environment variables (TRL's recipe key)."""
    if not isinstance(env, dict):
        raise ConfigError(f"{path}: env is not a mapping; write it as `env: {{NAME: value}}`, one variable a key.")
    for name, value in env.items():
        os.environ[str(name)] = str(value)


def _default(f: dataclasses.Field) -> Any:
    """A dataclass field's default (None where it has none, or a factory's value)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _renamed(key: str) -> str:
    """The name transformers 5 gave a `TrainingArguments` key, with a note on stderr that it was read so."""
    print(f"colograd: note: {key} was renamed {RENAMED_KEYS[key]} in transformers 5; read as such.", file=sys.stderr)
    return RENAMED_KEYS[key]


def _fail(err: Exception | str, code: int = 2, debug: bool = False) -> NoReturn:
    """One line on stderr (after the traceback, with `debug`), then exit with `code`.

    The line is written in one call, so that the lines of ranks failing together do not run into each other. Every
    local rank of a launch meets a mistake in its inputs at once, and the launcher stops the other ranks once one has
    exited with an error: local rank 0, or a process outside a launch, says its line at once; another local rank
    says its line only if it is still running `SAID_WAIT_S` later. So the line is said once a machine, and still
    when a rank fails alone.
    """
    if isinstance(err, SaidBefore) and not debug:  # a restart of a launch whose first attempt said it
        sys.exit(code)
    if debug and isinstance(err, Exception):
        traceback.print_exception(err)
    hint = "" if debug or code == 2 else " (rerun with --debug for the traceback)"
    line = f"colograd: error: {str(err).strip().splitlines()[0]}{hint}\n"
    local = os.environ.get("LOCAL_RANK", "").strip()
    if not debug and local.isdigit() and int(local) > 0:
        time.sleep(SAID_WAIT_S)  # stopped here by the launcher when local rank 0 has failed too
    sys.stderr.write(line)
    sys.stderr.flush()
    sys.exit(code)


# How long a local rank other than 0 waits before saying its line: local rank 0's exit and the launcher's check (every
# 0.1 s) fit in it. That exit skips the libraries' teardown when train.py runs as a script (`run_then_exit`: its atexit
# handlers, a tracker's last upload among them, then the exit); with the teardown it took 3-6 s on a busy 2-core
# machine.
SAID_WAIT_S = 10.0


if __name__ == "__main__":
    run_then_exit(cli)  # the process ends with cli's exit code, without the interpreter's teardown
