"""ConfigManager: recipe lookup, tyro overrides, --help docstrings, run files and their errors."""

import subprocess
import sys

import pytest

from hyper_parallel.config import ConfigError, ConfigManager

TOY = "tests.torch.ut.recipes.toy_registry"


def parse(*args):
    return ConfigManager().parse_args(["--module", TOY, *args])


def test_recipe_and_nested_overrides():
    cfg = parse("--config", "toy_small", "--training.steps", "20", "--model.hidden_dim", "12",
                "--model.gate_proj.param_init.std", "0.5", "--parallelism.tensor_parallel_degree=2")
    assert cfg.training.steps == 20
    assert cfg.model.hidden_dim == 12
    assert cfg.model.gate_proj.param_init.std == 0.5
    assert cfg.parallelism.tensor_parallel_degree == 2


def test_recipes_derive_from_each_other():
    assert parse("--config", "toy_large").model.hidden_dim == 64


def test_unknown_recipe_lists_available():
    with pytest.raises(ConfigError, match=r"toy_large, toy_small"):
        parse("--config", "toy_smal")


def test_unknown_module_lists_available():
    with pytest.raises(ConfigError, match="available modules"):
        ConfigManager().parse_args(["--module", "no_such_model_xyz", "--config", "x"])


def test_missing_module_flag():
    with pytest.raises(ConfigError, match="--module and --config are required"):
        ConfigManager().parse_args(["--config", "toy_small"])


def test_bad_field_is_an_error():
    with pytest.raises(SystemExit):
        parse("--config", "toy_small", "--training.stepz", "3")


def test_run_file_toml_and_yaml(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("[training]\nsteps = 7\nmax_norm = 2\n[model]\nhidden_dim = 5\n")
    cfg = parse("--config", "toy_small", "--config-file", str(toml))
    assert (cfg.training.steps, cfg.training.max_norm, cfg.model.hidden_dim) == (7, 2.0, 5)
    # the command line wins over the run file
    cfg = parse("--config", "toy_small", "--config-file", str(toml), "--training.steps", "9")
    assert cfg.training.steps == 9
    yml = tmp_path / "run.yaml"
    yml.write_text("training:\n  steps: 11\n")
    assert parse("--config", "toy_small", "--config-file", str(yml)).training.steps == 11


def test_run_file_unknown_key_suggests_close_match(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[training]\nstesp = 7\n")
    with pytest.raises(ConfigError, match=r"unknown key 'training.stesp'; did you mean 'training.steps'"):
        parse("--config", "toy_small", "--config-file", str(f))
    f.write_text("[trainin]\nsteps = 7\n")
    with pytest.raises(ConfigError, match="did you mean 'training'"):
        parse("--config", "toy_small", "--config-file", str(f))


def test_run_file_type_error_names_key(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[training]\nsteps = "many"\n')
    with pytest.raises(ConfigError, match="training.steps.*integer"):
        parse("--config", "toy_small", "--config-file", str(f))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "hyper_parallel.config.manager", "--module", TOY, *args],
                          capture_output=True, text=True, timeout=120)


def test_help_shows_field_docstrings():
    out = _cli("--config", "toy_small", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "Number of optimizer steps to run." in text
    assert "Intermediate size" in text


def test_print_resolved_config():
    out = _cli("--config", "toy_small", "--training.steps", "3")
    assert out.returncode == 0, out.stderr
    assert '"steps": 3' in out.stdout
