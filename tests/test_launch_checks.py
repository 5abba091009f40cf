"""Validated before anything starts: the model, the environment, the loss and every value's type are checked at launch,
each error is one line naming the config key, and an unfinished run is not resumed with a config that trains
differently unless asked."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import rlhpc.algo  # noqa: F401  (registers the algorithms' config checks)
from rlhpc.config import schema as config_mod
from rlhpc.config.schema import ConfigError, ModelConfig
from rlhpc.modeling import models
from rlhpc.preflight import checks as preflight
from rlhpc.preflight import rundir as run_setup
from rlhpc.preflight.rundir import RunDirError, prepare_run_dir

TESTS = Path(__file__).resolve().parent


def cfg_of(tmp_path, **sections):
    return config_mod.to_typed({"run_dir": str(tmp_path / "run"), **sections})


def launch(tmp_path, *overrides, env=None):
    return subprocess.run([sys.executable, "-m", "rlhpc.launch", "+exp=reverse_text", f"run_dir={tmp_path / 'run'}",
                           *overrides], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)


@pytest.mark.parametrize("override, message", [
    ("trainer.steps=many", "error: config key `trainer.steps`: Value 'many' of type 'str' could not be converted"),
    ("model.extra=5", "error: config key `model.extra`: Cannot assign int to Dict"),
    ("trainer.stepz=3", "error: config key `trainer.stepz`: Key 'stepz' not in 'TrainerConfig' (did you mean "
                        "`trainer.steps`?)"),
    ("trainer.zzz=3", "error: config key `trainer.zzz`: Key 'zzz' not in 'TrainerConfig' (trainer has: steps, "
                      "num_ranks, "),
    ("+model.extra.num_expert=8", "error: config key `model.extra.num_expert`: not a setting of transformers' qwen3 "
                                  "config, which would ignore it"),
    ("+model.extra.head_dim=3", "error: config key `model`: the qwen3 model built from model.*'s sizes and "
                                "model.extra does not run: RuntimeError: The size of tensor a (3) must match"),
    ("model.arch=qwen4", "error: config key `model.arch`: 'qwen4' is not a transformers model type (did you mean "
                         "'qwen3'"),
    ("env=nope", "error: config group `env`: no option 'nope' (conf/env/ has: "),
    ("algo.name=nope", "error: config key `algo.name`: unknown loss 'nope'"),
    ("model.path=/does/not/exist", "error: config key `model.path`: /does/not/exist is not a folder"),
    ("env.name=nope", "error: config key `env.name`: no environment 'nope'"),
])
def test_a_bad_value_is_one_line_naming_the_key_and_nothing_starts(tmp_path, override, message):
    refused_in_one_line(launch(tmp_path, override), message, tmp_path)


def test_a_wrong_name_is_named_before_the_model_is_checked(tmp_path):
    # The quick checks (the loss, the environment) come before the model's, which loads and runs the model: with both
    # wrong, the name is what the user hears about, at once.
    refused_in_one_line(launch(tmp_path, "algo.name=nope", "+model.extra.head_dim=3"),
                        "error: config key `algo.name`: unknown loss 'nope'", tmp_path)
    refused_in_one_line(launch(tmp_path, "env.name=nope", "model.path=/does/not/exist"),
                        "error: config key `env.name`: no environment 'nope'", tmp_path)


def refused_in_one_line(proc, message, tmp_path):
    """Exit code 2, one line on stderr that starts with `message`, no traceback, and no run directory written."""
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command, override, message", [
    ("rlhpc.sft", "trainer.stepz=1", "error: config key `trainer.stepz`: Key 'stepz' not in 'TrainerConfig'"),
    ("rlhpc.sft", "async_level=-1", "error: config key `async_level`: must be >= 0"),
    ("rlhpc.serve", "env=nope", "error: config group `env`: no option 'nope'"),
    ("rlhpc.eval", "eval.kk=3", "error: config key `eval.kk`: Key 'kk' not in 'EvalCommandKeys'"),
    ("rlhpc.eval", "model.path=/does/not/exist", "error: config key `model.path`: /does/not/exist is not a folder"),
])
def test_the_other_commands_report_a_bad_value_in_one_line_too(tmp_path, command, override, message):
    proc = subprocess.run([sys.executable, "-m", command, f"run_dir={tmp_path / 'run'}", override],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    refused_in_one_line(proc, message, tmp_path)

NO_MODEL_PATH = ("error: config key `model.path`: no value: the preset takes it from the environment variable "
                 "RLHPC_MODEL_PATH, which is not set; pass model.path=<a Hugging Face checkpoint folder> on the "
                 "command line, or set RLHPC_MODEL_PATH=<that folder> in the environment")


def without_model_path():
    return {k: v for k, v in os.environ.items() if k != "RLHPC_MODEL_PATH"}


@pytest.mark.parametrize("command", [("rlhpc.launch", "+exp=qwen3_30b_a3b"), ("rlhpc.sft", "model=qwen3_0_6b"),
                                     ("rlhpc.serve", "model=qwen3_0_6b"), ("rlhpc.eval", "model=qwen3_0_6b")])
def test_a_preset_checkpoint_without_its_folder_is_refused_naming_both_ways_to_give_it(tmp_path, command):
    # conf/model/*.yaml of real checkpoints read model.path from ${oc.env:RLHPC_MODEL_PATH}: OmegaConf's own words
    # ("Environment variable 'RLHPC_MODEL_PATH' not found") named neither the key to pass nor the folder it wants.
    proc = subprocess.run([sys.executable, "-m", *command, f"run_dir={tmp_path / 'run'}"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env=without_model_path())
    refused_in_one_line(proc, NO_MODEL_PATH, tmp_path)
    assert proc.stderr.strip() == NO_MODEL_PATH


def test_a_dry_run_without_the_model_path_is_told_that_a_folder_only_the_cluster_holds_will_do(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rlhpc.launch", "+exp=qwen3_30b_a3b", "dry_run=true"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=without_model_path())
    refused_in_one_line(proc, NO_MODEL_PATH, tmp_path)
    assert proc.stderr.strip() == NO_MODEL_PATH + (" (a dry run does not read the folder: one that only the cluster "
                                                   "holds will do)")
    planned = subprocess.run([sys.executable, "-m", "rlhpc.launch", "+exp=qwen3_30b_a3b", "dry_run=true",
                              f"model.path={tmp_path / 'on-the-cluster'}"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path, env=without_model_path())
    assert planned.returncode == 0, planned.stderr
    assert "from the published qwen3_30b_a3b shape (model.path is not readable here)" in planned.stdout


def test_a_model_built_in_code_is_checked_by_building_and_running_it():
    """Every preset built in code passes; a key of model.extra that transformers would silently keep (a typo) is
    refused with the keys it resembles, while a legacy key the config converts is accepted and takes effect."""
    for preset in ("tiny_qwen3", "tiny_qwen3_moe", "tiny_glm5"):
        values = OmegaConf.load(TESTS.parent / "conf" / "model" / f"{preset}.yaml")
        model = config_mod.to_typed({"run_dir": "r", "model": values}).model
        assert models.built_model_problem(model) is None, preset
    moe = ModelConfig(arch="qwen3_moe", extra={"num_expert": 8})
    assert models.built_model_problem(moe) == (
        "config key `model.extra.num_expert`: not a setting of transformers' qwen3_moe config, which would ignore it "
        "(did you mean `model.extra.num_experts` or `model.extra.num_local_experts`?)")
    legacy = ModelConfig(extra={"rope_theta": 500000.0})
    assert models.built_model_problem(legacy) is None
    tok = models.build_tokenizer()
    assert models._arch_config(legacy, len(tok), tok).rope_parameters["rope_theta"] == 500000.0
    assert models.built_model_problem(ModelConfig(extra={"rope_theta": "fast"})).startswith(
        "config key `model`: the qwen3 model built from model.*'s sizes and model.extra does not run: TypeError")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return models.build(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1), tmp_path_factory.mktemp("m"))


def test_a_model_path_needs_a_loadable_config_and_tokenizer(tmp_path, model_dir):
    preflight.check_model(cfg_of(tmp_path, model={"path": str(model_dir)}))  # the real thing passes
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^config key `model.path`: no loadable model config in .*empty"):
        preflight.check_model(cfg_of(tmp_path, model={"path": str(tmp_path / "empty")}))
    weights_only = tmp_path / "weights_only"
    weights_only.mkdir()
    (weights_only / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"^config key `model.path`: no loadable tokenizer in .*weights_only"):
        preflight.check_model(cfg_of(tmp_path, model={"path": str(weights_only)}))



def test_a_model_path_needs_whole_weights(tmp_path, model_dir):
    """A truncated or foreign weights file, or a shard the index names but the folder lacks, is refused at launch,
    naming the file: the headers are read, not the tensors."""
    import shutil

    def copy(name):
        return Path(shutil.copytree(model_dir, tmp_path / name))

    truncated = copy("truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ConfigError, match=r"^config key `model.path`: .*truncated/model.safetensors: not a whole "
                                          r"safetensors file \(an interrupted copy\?\): SafetensorError: .*incomplete"):
        preflight.check_model(cfg_of(tmp_path, model={"path": str(truncated)}))
    foreign = copy("foreign")
    (foreign / "model.safetensors").write_bytes(b"<html>proxy login</html>")
    with pytest.raises(ConfigError, match=r"foreign/model.safetensors: not a whole safetensors file .*SafetensorError"):
        preflight.check_model(cfg_of(tmp_path, model={"path": str(foreign)}))
    sharded = copy("sharded")
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ConfigError, match=r"model-00002-of-00002.safetensors: missing \(the checkpoint's index names"):
        preflight.check_model(cfg_of(tmp_path, model={"path": str(sharded)}))
    none = copy("none")
    (none / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"no model.safetensors or model.safetensors.index.json in .*none \(the "
                                          r"trainer loads safetensors"):
        preflight.check_model(cfg_of(tmp_path, model={"path": str(none)}))
    proc = launch(tmp_path, f"model.path={truncated}")  # as the user meets it
    refused_in_one_line(proc, f"error: config key `model.path`: {truncated / 'model.safetensors'}: not a whole", tmp_path)


def test_a_model_that_passed_its_checks_is_not_checked_again_until_it_changes(tmp_path, model_dir, monkeypatch):
    """The launcher remembers the models that passed its checks (rlhpc/modeling/remembered.py): a launch of the same
    model skips importing transformers and building it. A changed key or a changed file is checked again: a checkpoint
    damaged since the last launch is refused."""
    import shutil

    monkeypatch.setenv("RLHPC_CACHE_DIR", str(tmp_path / "cache"))
    checked = []
    real = preflight._check_model
    monkeypatch.setattr(preflight, "_check_model", lambda cfg, trainer: (checked.append(cfg.model), real(cfg, trainer)))
    built = cfg_of(tmp_path, model={"hidden_size": 32, "intermediate_size": 64, "num_layers": 1})
    preflight.check_model(built)
    preflight.check_model(built)
    assert len(checked) == 1
    preflight.check_model(cfg_of(tmp_path, model={"hidden_size": 32, "intermediate_size": 64, "num_layers": 2}))
    assert len(checked) == 2  # another model
    copy = Path(shutil.copytree(model_dir, tmp_path / "copy"))
    preflight.check_model(cfg_of(tmp_path, model={"path": str(copy)}))
    preflight.check_model(cfg_of(tmp_path, model={"path": str(copy)}))
    assert len(checked) == 3
    data = (copy / "model.safetensors").read_bytes()
    (copy / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ConfigError, match=r"copy/model.safetensors: not a whole safetensors file"):
        preflight.check_model(cfg_of(tmp_path, model={"path": str(copy)}))
    # As a user meets it: the second dry run of a model imports no transformers at all (the memory plan's shape is
    # remembered too), and prints the same plan.
    env = dict(os.environ, RLHPC_CACHE_DIR=str(tmp_path / "cache2"))
    runs = [subprocess.run([sys.executable, "-X", "importtime", "-m", "rlhpc.launch", "+exp=reverse_text",
                            f"run_dir={tmp_path / 'run'}", "dry_run=true"], capture_output=True, text=True,
                           timeout=120, cwd=tmp_path, env=env) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-2000:]
    imported = [{line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time")}
                for r in runs]
    assert "transformers" in imported[0] and "transformers" not in imported[1] and "torch" not in imported[1]
    assert runs[0].stdout == runs[1].stdout


def test_a_turn_must_fit_in_the_models_context(tmp_path, model_dir):
    """env=math asks for 512 new tokens; the model built in code holds 256: refused before anything starts, naming
    both keys (it used to run and score 0, with a warning in the workers' logs only)."""
    refused_in_one_line(launch(tmp_path, "env=math"), (
        "error: config key `env.max_new_tokens`: 512 new tokens leave no room for a prompt in "
        "model.max_position_embeddings (256); set model.max_position_embeddings=1024"), tmp_path)
    # A checkpoint's context is its own: the refusal says what can change.
    with pytest.raises(ConfigError, match=r"^config key `env.max_new_tokens`: 300 new tokens .* the context of "
                                          r"model.path's config \(256 tokens\); lower env.max_new_tokens "
                                          r"\(env.max_new_tokens=128 leaves half the context to the prompt\) or use a "
                                          r"model with a longer context$"):
        preflight.check_context(cfg_of(tmp_path, model={"path": str(model_dir)}, env={"max_new_tokens": 300}))
    with pytest.raises(ConfigError, match=r"within inference.max_model_len \(100\)"):
        preflight.check_context(cfg_of(tmp_path, env={"max_new_tokens": 100},
                                       inference={"engine": "vllm", "max_model_len": 100}))


@pytest.mark.parametrize("sections, fix", [
    ({"env": {"name": "math", "max_new_tokens": 512}},
     "set model.max_position_embeddings=1024 (a power of two that holds a prompt and 512 new tokens)"),
    ({"env": {"name": "wordle", "max_new_tokens": 256}},  # the environment's own 6 turns
     "set model.max_position_embeddings=2048 (a power of two that holds a prompt and 6 turns of 256 new tokens)"),
    ({"env": {"name": "math", "max_new_tokens": 512, "max_turns": 3, "max_episode_tokens": 5000}},
     "set model.max_position_embeddings=8192 (a power of two that holds env.max_episode_tokens=5000)"),
    ({"env": {"name": "math", "max_new_tokens": 512}, "model": {"max_position_embeddings": 4096},
      "inference": {"engine": "vllm", "max_model_len": 300}},
     "set inference.max_model_len=1024 (a power of two that holds a prompt and 512 new tokens)"),
    ({"env": {"name": "math", "max_new_tokens": 512}, "inference": {"engine": "vllm", "max_model_len": 300}},
     "set model.max_position_embeddings=1024 inference.max_model_len=1024 (a power of two that holds a prompt and "
     "512 new tokens)"),
])
def test_a_turn_too_long_for_the_model_built_in_code_is_refused_naming_a_context_that_fits(tmp_path, sections, fix):
    """The model built in code (no model.path) takes its context from model.max_position_embeddings, and vLLM from
    inference.max_model_len: the refusal names the values that hold the episode, and those values are accepted."""
    with pytest.raises(ConfigError) as refused:
        preflight.check_context(cfg_of(tmp_path, **sections))
    assert str(refused.value).endswith(f"; {fix} or lower env.max_new_tokens")
    overrides = OmegaConf.from_dotlist(fix[len("set "):fix.index(" (")].split())
    fixed = cfg_of(tmp_path, **OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(sections), overrides)))
    preflight.check_context(fixed)  # accepted, with room for the whole episode
    assert preflight.context_tokens(fixed) >= preflight.episode_tokens(fixed)[0]

class Broken:
    """Stands in for an environment whose constructor fails (a missing data file, say)."""


def test_the_environment_must_resolve_and_accept_its_args(tmp_path):
    preflight.check_env(cfg_of(tmp_path))  # reverse_text with no args
    with pytest.raises(ConfigError, match=r"^config key `env.args`: ReverseText does not accept \{'colour': 'red'\}"):
        preflight.check_env(cfg_of(tmp_path, env={"args": {"colour": "red"}}))
    with pytest.raises(ConfigError, match=r"^config key `env.cls`: cannot import 'no_such_module:Env'"):
        preflight.check_env(cfg_of(tmp_path, env={"cls": "no_such_module:Env"}))
    with pytest.raises(ConfigError, match=r"^config key `env.args`: environment 'test_launch_checks:failing_env' "
                                          r"failed to start with \{\}: FileNotFoundError: tasks.jsonl"):
        preflight.check_env(cfg_of(tmp_path, env={"cls": "test_launch_checks:failing_env"}))
    with pytest.raises(ConfigError, match=r"^config key `env.tool_parser`"):
        preflight.check_env(cfg_of(tmp_path, env={"tool_parser": "no_such_module:parse"}))


def failing_env(**kwargs):
    raise FileNotFoundError("tasks.jsonl")


def test_the_loss_must_resolve(tmp_path):
    preflight.check_loss(cfg_of(tmp_path, algo={"name": "poison_loss:nan_grpo"}))  # an import path that exists
    with pytest.raises(ConfigError, match=r"^config key `algo.name`: cannot import loss 'poison_loss:no_such_fn'"):
        preflight.check_loss(cfg_of(tmp_path, algo={"name": "poison_loss:no_such_fn"}))


def trained_run(tmp_path, **sections):
    """An unfinished run directory that has trained: its config saved, its warm-started model READY."""
    cfg = cfg_of(tmp_path, **sections)
    run = prepare_run_dir(cfg)
    models.build(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1), run.model)
    (run.model / "READY").write_text("{}")
    return run


def test_a_damaged_warm_started_model_is_named_before_a_resumed_run_starts(tmp_path):
    run = trained_run(tmp_path)
    data = (run.model / "model.safetensors").read_bytes()
    (run.model / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(RunDirError, match=r"its warm-started model is damaged \(.*model/model.safetensors: not a whole "
                                          r"safetensors file .*\); delete .*model to warm-start again"):
        prepare_run_dir(cfg_of(tmp_path))


def test_a_run_whose_checkpoints_are_all_damaged_is_refused_naming_each(tmp_path, capsys):
    import torch

    from rlhpc.train import checkpoint

    run = trained_run(tmp_path)
    capsys.readouterr()
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    for step in (2, 4):
        checkpoint.save(run.checkpoints, step, model, optimizer, scheduler, {})
    prepare_run_dir(cfg_of(tmp_path))  # both whole: resumed quietly
    assert "damaged" not in capsys.readouterr().err
    (run.checkpoints / "step_00000004" / "__0_0.distcp").unlink()
    prepare_run_dir(cfg_of(tmp_path))
    assert "damaged checkpoint(s) skipped (step_00000004: __0_0.distcp is missing); resuming from the newest whole " \
           "one, step_00000002" in capsys.readouterr().err
    (run.checkpoints / "step_00000002" / ".metadata").write_bytes(b"garbage")
    with pytest.raises(RunDirError, match=r"no whole checkpoint to resume from \(step_00000004: __0_0.distcp is "
                                          r"missing; step_00000002: .metadata unreadable .*\); move .*checkpoints "
                                          r"aside to train RL again from the warm-started model"):
        prepare_run_dir(cfg_of(tmp_path))


def test_a_run_dir_that_is_a_file_or_cannot_be_created_is_named(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(RunDirError, match=r"afile is a file, not a folder"):
        prepare_run_dir(config_mod.to_typed({"run_dir": str(tmp_path / "afile")}))
    with pytest.raises(RunDirError, match=r"cannot be created: .*choose another run_dir"):
        prepare_run_dir(config_mod.to_typed({"run_dir": str(tmp_path / "afile" / "run")}))


def test_an_unfinished_run_is_not_resumed_with_a_config_that_trains_differently(tmp_path):
    run = trained_run(tmp_path, trainer={"optim": {"lr": 1e-3}})
    changed = cfg_of(tmp_path, trainer={"optim": {"lr": 3e-3}}, algo={"clip_high": 0.28}, env={"args": {"n": 1}})
    with pytest.raises(RunDirError) as e:
        prepare_run_dir(changed)
    text = str(e.value)
    assert "holds an unfinished run whose config differs in keys that change training" in text
    assert "trainer.optim.lr: 0.001 -> 0.003" in text and "algo.clip_high: 0.2 -> 0.28" in text
    assert "env.args: {} -> {'n': 1}" in text and "resume.allow_config_change=true" in text
    assert config_mod.load(run.root).trainer.optim.lr == 1e-3  # the saved config is untouched


def test_allow_config_change_resumes_with_the_new_values_and_records_the_change(tmp_path):
    run = trained_run(tmp_path)
    prepare_run_dir(cfg_of(tmp_path, seed=7, resume={"allow_config_change": True}))
    assert config_mod.load(run.root).seed == 7
    (entry,) = [json.loads(line) for line in (run.root / "config_changes.jsonl").read_text().splitlines()]
    assert entry["changes"] == [["seed", 0, 7]]


def test_keys_that_do_not_change_training_may_change_on_resume(tmp_path):
    run = trained_run(tmp_path)
    prepare_run_dir(cfg_of(tmp_path, trainer={"steps": 500, "checkpoint_interval": 10}, inference={"num_workers": 5},
                           launcher={"timeout_s": 60.0}, eval={"interval": 5}))
    assert config_mod.load(run.root).trainer.steps == 500


def test_a_run_that_never_trained_may_be_relaunched_with_any_config(tmp_path):
    prepare_run_dir(cfg_of(tmp_path, seed=1))  # e.g. a launch that failed before the warm start finished
    prepare_run_dir(cfg_of(tmp_path, seed=2))


def test_the_changes_ignore_keys_a_saved_config_lacks(tmp_path):
    saved = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(cfg_of(tmp_path))))
    del saved.trainer["max_bad_steps"]  # written by an older rlhpc
    assert run_setup.training_changes(saved, cfg_of(tmp_path, trainer={"max_bad_steps": 9})) == []


@pytest.mark.slow
def test_a_refused_resume_is_reported_by_the_launch_command(tmp_path):
    trained_run(tmp_path)
    env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = launch(tmp_path, "algo.clip_high=0.3", "algo.name=poison_loss:nan_grpo", env=env)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: run_dir=") and "algo.clip_high" in proc.stderr
    assert "algo.name: 'grpo' -> 'poison_loss:nan_grpo'" in proc.stderr


def write_job(cwd, *overrides):
    """A launch that only writes its Slurm job (launcher.submit=false): the whole launch path, nothing started."""
    return subprocess.run([sys.executable, "-m", "rlhpc.launch", "+exp=reverse_text", "launcher=sbatch",
                           "launcher.submit=false", *overrides], capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.slow  # over 10 s here: the default tier stays within 10 minutes (docs/testing.md)
def test_launches_named_by_the_same_second_get_folders_of_their_own(tmp_path):
    # The default run_dir is runs/<exp>/<time to the second>: two launches in one second (a script starting runs in
    # the background) would share it. A year-long "second" makes the collision certain.
    procs = [write_job(tmp_path, "run_dir=runs/${now:%Y}") for _ in range(2)]
    assert all(p.returncode == 0 for p in procs), [p.stderr for p in procs]
    year = time.strftime("%Y")
    for p, name in zip(procs, [year, f"{year}-2"]):
        run_dir = tmp_path / "runs" / name
        assert f"wrote {run_dir}/job.sbatch" in p.stdout
        assert f"export RLHPC_RUN_DIR={run_dir}\n" in (run_dir / "job.sbatch").read_text()
        assert OmegaConf.load(run_dir / "config.yaml").run_dir == f"runs/{name}"
    default = write_job(tmp_path)
    assert default.returncode == 0, default.stderr
    assert len(list((tmp_path / "runs" / "reverse_text").iterdir())) == 1


@pytest.mark.slow  # over 10 s here: the default tier stays within 10 minutes (docs/testing.md)
def test_a_run_dir_given_by_name_is_never_renamed_and_a_launch_into_it_meanwhile_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    assert write_job(tmp_path, f"run_dir={run_dir}").returncode == 0
    with run_setup.launch_lock(run_dir):  # another launch is writing it now
        proc = write_job(tmp_path, f"run_dir={run_dir}")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: run_dir={run_dir} is being launched into right now (pid {os.getpid()} on "
                                   f"{os.uname().nodename}): wait for that launch to end, or choose another run_dir")
    assert write_job(tmp_path, f"run_dir={run_dir}").returncode == 0  # relaunched once the other has ended
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_new_run_dirs_are_made_exclusively(tmp_path):
    made = [run_setup.new_run_dir(tmp_path / "runs" / "x") for _ in range(3)]
    assert [p.name for p in made] == ["x", "x-2", "x-3"] and all(p.is_dir() for p in made)
    (tmp_path / "afile").write_text("")
    with pytest.raises(RunDirError, match=r"afile/x cannot be created: .*; choose another run_dir"):
        run_setup.new_run_dir(tmp_path / "afile" / "x")


@pytest.mark.slow  # over 10 s here: the default tier stays within 10 minutes (docs/testing.md)
def test_a_cluster_python_the_jobs_tasks_could_not_run_is_refused_at_launch_not_in_the_job(tmp_path):
    # The tasks run `cluster.python -m rlhpc.role` from this folder once the job has its nodes, which may be hours
    # later: a path that does not exist, a file that is not a program, or a Python without rlhpc are named at launch.
    missing = tmp_path / "no-env" / "bin" / "python"
    not_a_program = tmp_path / "python.txt"
    not_a_program.write_text("")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=120)
    bare = tmp_path / "bare" / "bin" / "python"
    for python, says in [(missing, "does not exist on this machine"), (not_a_program, "is not an executable file"),
                         (bare, "cannot import rlhpc (ModuleNotFoundError: No module named ")]:
        proc = write_job(tmp_path, f"cluster.python={python}", f"run_dir={tmp_path / 'run'}")
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(f"error: config key `cluster.python`: {python} {says}"), proc.stderr
        assert not (tmp_path / "run").exists()
    dry = write_job(tmp_path, f"cluster.python={missing}", "dry_run=true", f"run_dir={tmp_path / 'run'}")
    assert dry.returncode == 0 and f"  note: config key `cluster.python`: {missing} does not exist" in dry.stdout
    # Another name of this Python, which has rlhpc: the job is written. A venv's interpreter finds its packages through
    # the pyvenv.cfg one folder above the name it was started by: the other name goes through a link to the whole
    # environment, as a cluster's shared software folder often does.
    exe = Path(sys.executable)
    if exe.is_relative_to(sys.prefix):
        (tmp_path / "env").symlink_to(sys.prefix, target_is_directory=True)
        same = tmp_path / "env" / exe.relative_to(sys.prefix)
    else:
        same = tmp_path / "python"
        same.symlink_to(exe)
    proc = write_job(tmp_path, f"cluster.python={same}", f"run_dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr
    assert f"export RLHPC_PYTHON={same}\n" in (tmp_path / "run" / "job.sbatch").read_text()
    unknown = write_job(tmp_path, "cluster.python=python-of-nowhere", f"run_dir={tmp_path / 'run2'}")
    assert unknown.returncode == 2 and "python-of-nowhere is not on this machine's PATH" in unknown.stderr
    # Lines of cluster.setup may put it on PATH (module load, an activation): not judged here.
    later = write_job(tmp_path, "cluster.python=python-of-nowhere", "cluster.setup=[module load py]",
                      f"run_dir={tmp_path / 'run2'}")
    assert later.returncode == 0, later.stderr
