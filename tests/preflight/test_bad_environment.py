"""The environment a run starts in (colograd.preflight.env): every cache variable × every way a folder is unusable,
every hardware and launch variable × malformed values, the trackers, the offline hub; a refusal is one line before
anything loads, a risk one warning, and a valid setup (unset variables, folders still to be created) passes."""

import os

import pytest
from conftest import refused

from colograd.config.core import ConfigError, GRPOConfig
from colograd.preflight import env as preflight_env
from colograd.preflight.env import CACHES, HARDWARE, TRACKERS, Run, cache_issues, check_environment, hardware_issues

TINY = "recipes/grpo_tiny.yaml"
CACHE_VARIABLES = sorted({v for cache in CACHES for v, _ in cache.chain if v != "HOME"})
WANDB_VARIABLES = ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED", "WANDB_IDENTITY_TOKEN_FILE", "NETRC")
# A run that writes every cache (see `Run`).
EVERYTHING = Run(
    hub_names=("org/model",), loads_dataset=True, pretrained=True, compiles=True, gpu=True, remote_code=True
)
# A valid value of each hardware variable, and values none of them takes.
VALID = {
    "CUDA_VISIBLE_DEVICES": "0",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_CPU_OMP_THREADS_BIND": "auto",
    "RANK": "0",
    "LOCAL_RANK": "-1",  # alone; a launch's 0 comes with the other launch variables
    "WORLD_SIZE": "1",
    "LOCAL_WORLD_SIZE": "1",
    "MASTER_PORT": "29500",
}
MALFORMED = ("abc", "", "1.5", "-3", "4 GiB", "0x10")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No cache, hardware or tracker variable set; a writable home; two GPUs and cores 0-1 on this machine."""
    for name in [*CACHE_VARIABLES, *HARDWARE, *WANDB_VARIABLES, "TMPDIR", "TRANSFORMERS_CACHE", "HF_HUB_OFFLINE"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(preflight_env, "machine_gpus", lambda: 2)
    monkeypatch.setattr(preflight_env, "usable_cores", lambda: {0, 1})
    preflight_env._warned.clear()


def _read_only(tmp_path) -> str:
    """A folder no file can be created in: one without write permission, or, where this process writes there anyway
    (root), a read-only file system's."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    for candidate in (str(folder), "/sys/kernel", "/proc/self"):
        if os.path.isdir(candidate) and preflight_env.folder_problem(candidate) is not None:
            return candidate
    pytest.skip("no folder here refuses this process a file")


def _unusable(kind: str, tmp_path) -> str:
    """A path of one kind a cache folder cannot be."""
    if kind == "read-only folder":
        return _read_only(tmp_path)
    if kind == "a file":
        (tmp_path / "file").write_text("x")
        return str(tmp_path / "file")
    if kind == "under a file":
        (tmp_path / "file").write_text("x")
        return str(tmp_path / "file" / "cache")
    return os.path.join(_read_only(tmp_path), "missing", "cache")  # a parent that cannot be created


def _env() -> dict[str, str]:
    return dict(os.environ)


# --- caches --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["read-only folder", "a file", "under a file", "unwritable parent"])
@pytest.mark.parametrize("variable", CACHE_VARIABLES)
def test_cache_that_cannot_be_written_is_refused_naming_its_variable(variable, kind, tmp_path, monkeypatch):
    monkeypatch.setenv(variable, _unusable(kind, tmp_path))
    fatal = [issue for issue in cache_issues(EVERYTHING, _env()) if issue.fatal]
    assert fatal and fatal[0].text.startswith(f"{variable}="), fatal
    assert "a folder you can write to" in fatal[0].text


@pytest.mark.parametrize("variable", CACHE_VARIABLES)
def test_cache_folder_still_to_be_created_passes(variable, tmp_path, monkeypatch):
    monkeypatch.setenv(variable, str(tmp_path / "new" / "nested" / "cache"))
    assert cache_issues(EVERYTHING, _env()) == []
    assert not (tmp_path / "new").exists()  # checking creates nothing


@pytest.mark.parametrize("variable", CACHE_VARIABLES)
def test_cache_this_run_does_not_write_is_not_checked(variable, tmp_path, monkeypatch):
    monkeypatch.setenv(variable, _unusable("a file", tmp_path))
    assert not [issue for issue in cache_issues(Run(), _env()) if issue.fatal]


def test_hub_cache_only_read_offline_may_be_read_only(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", _read_only(tmp_path))
    online = cache_issues(Run(hub_names=("org/model",)), _env())
    assert online and "HF_HUB_OFFLINE=1" in online[0].text
    assert cache_issues(Run(hub_names=("org/model",), offline=True), _env()) == []


def test_unwritable_home_is_named_when_it_decides(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", _read_only(tmp_path))
    issues = cache_issues(Run(hub_names=("org/model",)), _env())
    assert issues[0].fatal and issues[0].text.startswith("HOME=") and "set HF_HUB_CACHE to" in issues[0].text


def test_first_variable_of_the_chain_decides(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", _unusable("a file", tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_XET_CACHE", str(tmp_path / "xet"))
    assert cache_issues(Run(hub_names=("org/model",)), _env()) == []


@pytest.mark.parametrize("kind", ["a file", "under a file", "unwritable parent"])
def test_unusable_tmpdir_is_a_warning(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", _unusable(kind, tmp_path))
    (issue,) = cache_issues(EVERYTHING, _env())
    assert not issue.fatal and issue.text.startswith("TMPDIR=") and "/tmp instead" in issue.text


def test_transformers_cache_is_not_read_and_says_so(monkeypatch):
    monkeypatch.setenv("TRANSFORMERS_CACHE", "/data/models")
    (issue,) = cache_issues(Run(), _env())
    assert not issue.fatal and "set HF_HUB_CACHE instead" in issue.text


# --- hardware and launch variables ---------------------------------------------------------------------------

NUMBERS = [name for name in HARDWARE if name not in ("CUDA_VISIBLE_DEVICES", "VLLM_CPU_OMP_THREADS_BIND")]


# OpenMP and MKL ignore a thread count they cannot read (the run goes on with every core): a warning.
IGNORED = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@pytest.mark.parametrize("value", MALFORMED)
@pytest.mark.parametrize("name", NUMBERS)
def test_malformed_number_is_named_with_its_variable(name, value, monkeypatch):
    monkeypatch.setenv(name, value)
    (issue,) = hardware_issues(_env())
    assert issue.fatal is (name not in IGNORED) and issue.text.startswith(f"{name}={value!r}"), issue


@pytest.mark.parametrize("name", list(HARDWARE))
def test_valid_value_passes(name, monkeypatch):
    monkeypatch.setenv(name, VALID[name])
    assert hardware_issues(_env()) == []


def test_every_hardware_variable_has_a_valid_value_here():
    assert set(VALID) == set(HARDWARE)


@pytest.mark.parametrize(
    ("value", "fatal", "message"),
    [
        ("7", True, "names GPU 7, but this machine has 2"),
        ("0,2", True, "names GPU 2"),
        ("abc", True, "'abc' is not a GPU index or UUID"),
        ("0,x", True, "'x' is not a GPU index"),
        ("1,1", True, "names a GPU twice"),
        ("", False, "hides all 2 GPUs"),
        ("-1", False, "hides all 2 GPUs"),
        ("1,0", None, None),
        ("GPU-8f6c1c5e-0000-0000-0000-000000000000", None, None),
    ],
)
def test_visible_devices_against_the_machines_gpus(value, fatal, message, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    issues = hardware_issues(_env())
    if message is None:
        assert issues == []
    else:
        assert issues[0].fatal is fatal and message in issues[0].text


@pytest.mark.parametrize("value", ["7", "", "abc"])
def test_visible_devices_mean_nothing_on_a_cpu_machine(value, monkeypatch):
    monkeypatch.setattr(preflight_env, "machine_gpus", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert hardware_issues(_env()) == []


def test_more_threads_than_cores_is_a_warning(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    (issue,) = hardware_issues(_env())
    assert not issue.fatal and "more threads than the 2 cores" in issue.text


@pytest.mark.parametrize("value", ["0-3", "99", "0-1|2-3", "nobind"])
def test_thread_binding_the_engine_never_reads_is_a_warning(value, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", value)
    (issue,) = hardware_issues(_env())
    assert not issue.fatal and "has no effect here" in issue.text


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 does not fit WORLD_SIZE=2"),
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1"}, "LOCAL_RANK=1 does not fit LOCAL_WORLD_SIZE=1"),
        ({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "2", "RANK": "0"}, "LOCAL_WORLD_SIZE=4 does not fit WORLD_SIZE=2"),
        ({"WORLD_SIZE": "2"}, "RANK is not"),
        ({"RANK": "1", "WORLD_SIZE": "2"}, None),
        ({"LOCAL_RANK": "-1"}, None),  # transformers' "no launcher"
        ({"LOCAL_RANK": "0"}, "LOCAL_RANK=0 is set, but MASTER_ADDR is not"),
        ({"LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "29500", "RANK": "0"}, "but WORLD_SIZE is not"),
        ({"LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "1"}, None),
    ],
)
def test_launch_variables_against_each_other(variables, message, monkeypatch):
    monkeypatch.setattr("torch.distributed.is_initialized", lambda: False)  # (an earlier engine's world of one)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    issues = hardware_issues(_env())
    if message is None:
        assert issues == []
    else:
        assert issues[0].fatal and message in issues[0].text


def test_launch_variables_are_not_judged_once_the_process_group_is_formed(monkeypatch):
    """vLLM's CPU platform sets LOCAL_WORLD_SIZE to the engine's tensor-parallel size when an engine starts: rank 1
    of a launch then holds LOCAL_RANK=1, LOCAL_WORLD_SIZE=1, and its next trainer must still build."""
    for name, value in {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1", "RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("torch.distributed.is_initialized", lambda: False)
    assert hardware_issues(_env())[0].fatal
    monkeypatch.setattr("torch.distributed.is_initialized", lambda: True)
    assert hardware_issues(_env()) == []


# --- trackers and the offline hub ----------------------------------------------------------------------------


def _args(**fields) -> GRPOConfig:
    return GRPOConfig(output_dir="unused", vllm_enforce_eager=True, **fields)


@pytest.mark.parametrize("tracker", list(TRACKERS))
def test_tracker_not_installed_is_refused(tracker, monkeypatch):
    from transformers.integrations import integration_utils

    monkeypatch.setattr(integration_utils, TRACKERS[tracker][0], lambda: False)
    with pytest.raises(ConfigError, match=f"report_to: {tracker} is not installed; pip install"):
        check_environment(_args(report_to=[tracker]))


def test_wandb_without_login_is_refused_before_start_up():
    with pytest.raises(ConfigError, match="wandb has no login.*WANDB_MODE=offline"):
        check_environment(_args(report_to=["wandb"]))


@pytest.mark.parametrize(
    "variables",
    [{"WANDB_MODE": "offline"}, {"WANDB_MODE": "disabled"}, {"WANDB_API_KEY": "x" * 40}, {"NETRC": "netrc"}],
)
def test_wandb_login_found(variables, tmp_path, monkeypatch):
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    for name, value in variables.items():
        monkeypatch.setenv(name, str(tmp_path / value) if name == "NETRC" else value)
    check_environment(_args(report_to=["wandb"]))


def test_offline_hub_model_not_in_the_cache_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="model 'org/model' is not in the hub cache.*hf download org/model"):
        check_environment(_args(), "org/model")
    snapshot = tmp_path / "models--org--model" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--org--model" / "refs").mkdir()
    (tmp_path / "models--org--model" / "refs" / "main").write_text("abc")
    check_environment(_args(), "org/model")


def test_valid_environment_passes(monkeypatch):
    args = _args()  # before the launch variables, which would make it join a process group
    for name, value in VALID.items():
        monkeypatch.setenv(name, value)
    check_environment(args, "colograd:tiny-qwen2", "colograd:letters")


# --- where a user meets it -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variables", "flags", "message"),
    [
        ({"LOCAL_RANK": "abc"}, [], "LOCAL_RANK='abc' is not a whole number"),
        ({"MASTER_PORT": "http"}, [], "MASTER_PORT='http' is not a TCP port"),
        ({"VLLM_CPU_KVCACHE_SPACE": "4GB"}, [], "VLLM_CPU_KVCACHE_SPACE='4GB' is not a whole number"),
        ({}, ["--report_to", "wandb"], "wandb has no login"),
        ({"VLLM_CACHE_ROOT": "/dev/null"}, ["--vllm_enforce_eager", "false"], "VLLM_CACHE_ROOT='/dev/null'"),
    ],
)
def test_command_line_refuses_in_one_line(variables, flags, message, tmp_path):
    line = refused("--config", TINY, "--output_dir", str(tmp_path / "out"), *flags, env=variables)
    assert message in line


def test_trainer_refuses_before_its_engine(monkeypatch):
    from colograd import GRPOTrainer
    from colograd.models import tiny

    monkeypatch.setattr("colograd.trainer.Engine", None)  # never reached
    with pytest.raises(ConfigError, match="wandb has no login"):
        GRPOTrainer(
            tiny.build_model(),
            reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
            args=_args(report_to=["wandb"]),
            processing_class=tiny.build_tokenizer(),
        )


@pytest.mark.slow
@pytest.mark.parametrize("under", ["", "/inside"])
def test_a_cache_variable_that_breaks_the_libraries_import_gets_one_line(under, tmp_path):
    """Importing transformers creates TorchInductor's cache folder, before colograd's own checks run: a
    TORCHINDUCTOR_CACHE_DIR that names a file (or a path under one) fails there, and the command says so in one
    line naming the variable, instead of a traceback from torch's import."""
    import subprocess
    import sys

    from conftest import ROOT, _env

    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    env = {**_env(), "TORCHINDUCTOR_CACHE_DIR": f"{afile}{under}"}
    cmd = [sys.executable, str(ROOT / "colograd/train.py"), "--config", "recipes/grpo_tiny.yaml"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith(
        f"colograd: error: importing torch / transformers failed at TORCHINDUCTOR_CACHE_DIR={afile}"
    )
