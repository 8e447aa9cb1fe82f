"""launch.config: layering, coercion, validation and the wording of every error."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest
import yaml

from diloco.sim.units import parse_duration
from launch.config import Config, ConfigError, config_from_dict, dump_config, load_config
from launch.config.loader import ConfigBuilder, format_duration
from launch.config.schema import SECTIONS, describe_fields
from launch.config.validation import validate

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def error_of(files=(), overrides=(), extra=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(list(files), list(overrides), extra)
    return str(info.value)


def assert_one_line(msg: str) -> None:
    assert "\n" not in msg, msg


# ---------------------------------------------------------------------------------------------
# errors: unknown names
# ---------------------------------------------------------------------------------------------

def test_unknown_section_in_file_names_file_suggestion_and_sections(tmp_path):
    path = write(tmp_path, "bad.yaml", "modle:\n  size: tiny\n")
    msg = error_of([path])
    assert msg.startswith(path + ":"), msg
    assert "unknown section 'modle'" in msg
    assert "did you mean 'model'" in msg
    assert "sections are: model, data, optim, algo, sync, compress, transport, log, run, eval, sim" in msg
    assert_one_line(msg)


def test_unknown_section_from_set_names_the_flag():
    msg = error_of(overrides=["optimm.lr=1"])
    assert msg.startswith("--set optimm.lr=1:"), msg
    assert "unknown section 'optimm'" in msg
    assert "did you mean 'optim'" in msg


def test_unknown_key_in_file_suggests_and_lists_keys(tmp_path):
    path = write(tmp_path, "bad.yaml", "optim:\n  lrr: 0.1\n")
    msg = error_of([path])
    assert msg.startswith(path + ":"), msg
    assert "unknown key 'optim.lrr'" in msg
    assert "did you mean 'lr'" in msg
    assert "keys in 'optim' are:" in msg
    for key in ("name", "lr", "betas", "warmup_steps", "grad_clip"):
        assert key in msg.split("keys in 'optim' are:")[1]
    assert_one_line(msg)


def test_unknown_key_without_close_match_has_no_suggestion():
    msg = error_of(overrides=["run.zzzzzzzz=1"])
    assert "unknown key 'run.zzzzzzzz'" in msg
    assert "did you mean" not in msg
    assert "keys in 'run' are:" in msg


def test_override_without_equals_sign():
    msg = error_of(overrides=["optim.lr"])
    assert "--set" in msg and "'optim.lr'" in msg
    assert "expected section.key=value" in msg


def test_override_key_without_section():
    msg = error_of(overrides=["lr=1"])
    assert msg.startswith("--set lr=1:"), msg
    assert "key 'lr' must look like section.key" in msg


# ---------------------------------------------------------------------------------------------
# errors: wrong types and bounds (one field at a time)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "override, key, allowed",
    [
        ("optim.lr=fast", "optim.lr", "got 'fast', expected a number"),
        ("run.batch_size=2.5", "run.batch_size", "got 2.5, expected an integer"),
        ("log.wandb=maybe", "log.wandb", "got 'maybe', expected true or false"),
        ("optim.lr=-1", "optim.lr", "must be > 0"),
        ("optim.lr=0", "optim.lr", "must be > 0"),
        ("optim.lr=nan", "optim.lr", "expected a finite number"),
        ("algo.inner_steps=0", "algo.inner_steps", "got 0, must be > 0"),
        ("algo.outer_momentum=1", "algo.outer_momentum", "must be < 1"),
        ("data.val_fraction=0.9", "data.val_fraction", "must be <= 0.5"),
        ("optim.weight_decay=-0.1", "optim.weight_decay", "must be >= 0"),
        ("run.max_steps=[1, 2]", "run.max_steps", "expected an integer"),
        ("run.max_steps=true", "run.max_steps", "expected an integer"),
        ("optim.lr=true", "optim.lr", "expected a number"),
        ("data.source=web", "data.source", "allowed: stdlib, text, shards, hf"),
        ("optim.schedule=step", "optim.schedule", "allowed: cosine, linear, constant"),
        ("optim.betas=0.9", "optim.betas", "expected a list of 2 numbers"),
        ("optim.betas=0.9,0.95,0.99", "optim.betas", "expected a list of 2 numbers"),
        ("optim.betas=0.9,fast", "optim.betas", "expected a number"),
        ("run.max_time=soon", "run.max_time", "is not a duration (examples: 90s, 30m, 24h"),
        ("run.max_time=0", "run.max_time", "must be > 0"),
        ("transport.timeout=true", "transport.timeout", "a duration, not a boolean"),
        ("run.name=[a, b]", "run.name", "expected a string"),
    ],
)
def test_bad_value_from_set(override, key, allowed):
    msg = error_of(overrides=[override])
    assert msg.startswith(f"--set {override}: {key}: "), msg
    assert allowed in msg, msg
    assert_one_line(msg)


def test_bad_value_message_includes_field_documentation():
    msg = error_of(overrides=["optim.lr=fast"])
    assert "(Peak learning rate of the inner optimizer (with name: muon, of its AdamW part).)" in msg


@pytest.mark.parametrize(
    "yaml_text, key, allowed",
    [
        ("optim:\n  lr: fast\n", "optim.lr", "expected a number"),
        ("run:\n  batch_size: 2.5\n", "run.batch_size", "expected an integer"),
        ("log:\n  wandb: maybe\n", "log.wandb", "expected true or false"),
        ("optim:\n  lr: -0.001\n", "optim.lr", "must be > 0"),
        ("algo:\n  inner_steps: 0\n", "algo.inner_steps", "must be > 0"),
        ("run:\n  max_time: forever\n", "run.max_time", "is not a duration"),
        ("optim:\n  betas: [0.9]\n", "optim.betas", "expected a list of 2 numbers"),
    ],
)
def test_bad_value_from_file_names_the_file(tmp_path, yaml_text, key, allowed):
    path = write(tmp_path, "cfg.yaml", yaml_text)
    msg = error_of([path])
    assert msg.startswith(f"{path}: {key}: "), msg
    assert allowed in msg, msg


def test_bad_value_from_extra_flag_names_the_flag():
    msg = error_of(extra={"run.max_time": ("soon", "--max-time")})
    assert msg.startswith("--max-time: run.max_time: "), msg
    assert "is not a duration" in msg


def test_error_in_later_file_names_that_file(tmp_path):
    good = write(tmp_path, "good.yaml", "optim:\n  lr: 0.1\n")
    bad = write(tmp_path, "bad.yaml", "optim:\n  lr: fast\n")
    msg = error_of([good, bad])
    assert msg.startswith(bad + ":"), msg
    assert good not in msg


# ---------------------------------------------------------------------------------------------
# errors: checks across fields (validate)
# ---------------------------------------------------------------------------------------------

def test_text_source_without_path():
    msg = error_of(overrides=["data.source=text"])
    assert "data.path: data.source is 'text', which needs data.path" in msg
    assert_one_line(msg)


def test_hf_source_without_path():
    msg = error_of(overrides=["data.source=hf"])
    assert "data.source is 'hf', which needs data.path" in msg


def test_text_source_without_path_names_the_file_that_asked_for_text(tmp_path):
    path = write(tmp_path, "cfg.yaml", "data:\n  source: text\n")
    msg = error_of([path])
    assert path in msg, msg


def test_text_source_with_missing_path_names_file_key_and_path(tmp_path):
    missing = tmp_path / "no-such-corpus"
    path = write(tmp_path, "cfg.yaml", f"data:\n  source: text\n  path: {missing}\n")
    msg = error_of([path])
    assert msg.startswith(f"{path}: data.path: "), msg
    assert f"'{missing}' does not exist" in msg


@pytest.mark.parametrize("source", ["stdlib", "python"])
def test_a_path_the_built_in_corpus_would_ignore_is_refused(tmp_path, source):
    msg = error_of(overrides=[f"data.source={source}", f"data.path={tmp_path}"])
    assert msg.startswith(f"--set data.path={tmp_path}: data.path: "), msg
    assert "would not be read" in msg and "data.source to text" in msg
    msg = error_of(overrides=[f"data.val_path={tmp_path}"])  # stdlib by default
    assert msg.startswith(f"--set data.val_path={tmp_path}: data.val_path: "), msg
    load_config([], [f"data.source={source}", f"data.path={tmp_path}", "data.path="])  # emptied again: fine


def test_missing_val_path(tmp_path):
    msg = error_of(overrides=["data.source=text", f"data.path={tmp_path}", f"data.val_path={tmp_path / 'nope'}"])
    assert msg.startswith(f"--set data.val_path={tmp_path / 'nope'}: data.val_path: "), msg
    assert "does not exist" in msg


def test_shards_without_vocab_size(tmp_path):
    msg = error_of(overrides=["data.source=shards", f"data.path={tmp_path}"])
    assert "data.vocab_size" in msg
    assert "source 'shards' needs the vocabulary size" in msg


def test_shards_need_data_vocab_size_even_with_model_vocab_size(tmp_path):
    # the data's vocabulary bounds-checks every batch; the model's may be padded larger
    msg = error_of(overrides=["data.source=shards", f"data.path={tmp_path}", "model.vocab_size=50304"])
    assert "data.vocab_size" in msg and "shards" in msg
    cfg, _ = load_config([], ["data.source=shards", f"data.path={tmp_path}", "data.vocab_size=50257",
                              "model.vocab_size=50304"])
    assert cfg.model.vocab_size == 50304


def test_grad_accum_must_divide_batch_size(tmp_path):
    path = write(tmp_path, "cfg.yaml", "run:\n  batch_size: 10\n  grad_accum: 3\n")
    msg = error_of([path])
    assert msg.startswith(f"{path}: run.grad_accum: "), msg
    assert "3 does not divide run.batch_size=10" in msg


def test_max_steps_and_max_time_both_empty(tmp_path):
    path = write(tmp_path, "cfg.yaml", "run:\n  max_steps: null\n")
    msg = error_of([path])
    assert msg.startswith(f"{path}: run.max_steps: "), msg
    assert "run.max_time is empty too" in msg
    assert "set one of them" in msg


def test_unknown_model_size(tmp_path):
    path = write(tmp_path, "cfg.yaml", "model:\n  size: huge\n")
    msg = error_of([path])
    assert msg.startswith(f"{path}: model.size: "), msg
    assert "unknown size 'huge'" in msg
    assert "allowed: tiny, small, 150m, 1b" in msg


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cuda0", "CPU", "tpu"])
def test_bad_device(device):
    msg = error_of(overrides=[f"run.device={device}"])
    assert msg.startswith(f"--set run.device={device}: run.device: "), msg
    assert f"got '{device}'" in msg
    assert "allowed: auto, cpu, cuda, cuda:N, mps" in msg


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12", "mps"])
def test_good_device(device):
    cfg, _ = load_config([], [f"run.device={device}"])
    assert cfg.run.device == device


def test_bad_codec_chain():
    msg = error_of(overrides=["compress.codec=fp32+topk:0.1"])
    assert msg.startswith("--set compress.codec=fp32+topk:0.1: compress.codec: "), msg
    assert "stage 'topk' must come before 'fp32'" in msg
    msg = error_of(overrides=["compress.codec=int9"])
    assert "unknown codec stage 'int9'" in msg and "int8" in msg


@pytest.mark.parametrize("betas", ["0.9,1.0", "-0.1,0.9", "0.9,1.5"])
def test_betas_out_of_range(betas):
    msg = error_of(overrides=[f"optim.betas={betas}"])
    assert msg.startswith(f"--set optim.betas={betas}: optim.betas: "), msg
    assert "each beta must be in [0, 1)" in msg


def test_heads_must_divide_dim():
    msg = error_of(overrides=["model.dim=100", "model.n_heads=3"])
    assert "model.n_heads" in msg and "3 does not divide model.dim=100" in msg


def test_kv_heads_must_divide_heads():
    msg = error_of(overrides=["model.n_heads=4", "model.n_kv_heads=3"])
    assert msg.startswith("--set model.n_kv_heads=3: model.n_kv_heads: "), msg
    assert "3 does not divide model.n_heads=4" in msg


def test_dim_not_divisible_by_named_size_heads_is_a_config_error():
    msg = error_of(overrides=["model.dim=130"])
    assert msg.startswith("--set model.dim=130: model.dim: ") and "does not divide model.dim=130" in msg, msg


# ---------------------------------------------------------------------------------------------
# errors: the files themselves
# ---------------------------------------------------------------------------------------------

def test_file_that_is_not_a_mapping(tmp_path):
    path = write(tmp_path, "list.yaml", "- optim\n- run\n")
    msg = error_of([path])
    assert msg.startswith(path + ":"), msg
    assert "the top level must be a mapping of sections" in msg
    assert "got list" in msg


def test_file_that_is_a_scalar(tmp_path):
    path = write(tmp_path, "scalar.yaml", "just words\n")
    msg = error_of([path])
    assert msg.startswith(path + ":") and "got str" in msg


def test_section_that_is_not_a_mapping(tmp_path):
    path = write(tmp_path, "cfg.yaml", "optim: 0.1\n")
    msg = error_of([path])
    assert msg.startswith(path + ":"), msg
    assert "section 'optim' must be a mapping of keys" in msg


def test_invalid_yaml_syntax(tmp_path):
    path = write(tmp_path, "broken.yaml", "optim:\n  lr: [0.1\n run: {\n")
    msg = error_of([path])
    assert msg.startswith(path + ": not valid YAML"), msg


def test_config_file_not_found(tmp_path):
    path = str(tmp_path / "nope.yaml")
    msg = error_of([path])
    assert msg == f"{path}: config file not found"


def test_folder_instead_of_config_file(tmp_path):
    msg = error_of([str(tmp_path)])
    assert msg == f"{tmp_path}: config file not found"


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ---------------------------------------------------------------------------------------------
# positive cases
# ---------------------------------------------------------------------------------------------

def test_defaults_validate():
    validate(Config())
    cfg, builder = load_config()
    assert cfg == Config()
    assert builder.sources == {}
    assert builder.where("optim.lr") == "default"


def test_empty_file_and_empty_section_are_fine(tmp_path):
    empty = write(tmp_path, "empty.yaml", "")
    section = write(tmp_path, "section.yaml", "optim:\nrun:\n")
    cfg, _ = load_config([empty, section])
    assert cfg == Config()


def test_tiny_yaml_loads():
    cfg, builder = load_config([TINY])
    assert cfg.model.size == "tiny"
    assert cfg.data.seq_len == 128
    assert cfg.optim.lr == pytest.approx(3e-3) and isinstance(cfg.optim.lr, float)
    assert cfg.run.max_steps == 600
    assert builder.where("optim.lr") == TINY
    assert builder.where("optim.eps") == "default"


def test_files_layer_in_order_and_set_wins(tmp_path):
    a = write(tmp_path, "a.yaml", "optim:\n  lr: 0.1\n  warmup_steps: 7\nrun:\n  batch_size: 8\n")
    b = write(tmp_path, "b.yaml", "optim:\n  lr: 0.2\n")
    cfg, builder = load_config([a, b])
    assert cfg.optim.lr == 0.2 and cfg.optim.warmup_steps == 7 and cfg.run.batch_size == 8
    assert builder.where("optim.lr") == b and builder.where("optim.warmup_steps") == a
    cfg, _ = load_config([b, a])
    assert cfg.optim.lr == 0.1
    cfg, builder = load_config([a, b], ["optim.lr=0.3", "run.batch_size=4"])
    assert cfg.optim.lr == 0.3 and cfg.run.batch_size == 4 and cfg.optim.warmup_steps == 7
    assert builder.where("optim.lr") == "--set optim.lr=0.3"
    # later --set wins over an earlier one; extra (flags) win over --set
    cfg, builder = load_config([a], ["optim.lr=0.3", "optim.lr=0.4"], {"optim.lr": (0.5, "--lr")})
    assert cfg.optim.lr == 0.5 and builder.where("optim.lr") == "--lr"


def test_set_scientific_notation_becomes_float():
    cfg, _ = load_config([], ["optim.lr=1e-3"])
    assert isinstance(cfg.optim.lr, float)
    assert cfg.optim.lr == 0.001
    cfg, _ = load_config([], ["optim.eps=1E-10"])
    assert cfg.optim.eps == 1e-10


def test_file_scientific_notation_becomes_float(tmp_path):
    path = write(tmp_path, "cfg.yaml", "optim:\n  lr: 1e-3\n")
    assert yaml.safe_load(Path(path).read_text())["optim"]["lr"] == "1e-3"  # YAML 1.1 reads a string
    cfg, _ = load_config([path])
    assert cfg.optim.lr == 0.001 and isinstance(cfg.optim.lr, float)


@pytest.mark.parametrize("text", ["0.8,0.99", "[0.8, 0.99]", "0.8 0.99", "(0.8, 0.99)"])
def test_set_betas(text):
    cfg, _ = load_config([], [f"optim.betas={text}"])
    assert cfg.optim.betas == (0.8, 0.99)
    assert all(isinstance(b, float) for b in cfg.optim.betas)


def test_betas_from_file_list(tmp_path):
    path = write(tmp_path, "cfg.yaml", "optim:\n  betas: [0.85, 0.9]\n")
    cfg, _ = load_config([path])
    assert cfg.optim.betas == (0.85, 0.9)


@pytest.mark.parametrize("text, seconds", [("90s", 90.0), ("24h", 86400.0), ("30m", 1800.0), ("1.5h", 5400.0),
                                           ("500ms", 0.5), ("2d", 172800.0), ("45", 45.0), ("10min", 600.0)])
def test_set_max_time_durations(text, seconds):
    cfg, _ = load_config([], [f"run.max_time={text}"])
    assert cfg.run.max_time == seconds
    assert isinstance(cfg.run.max_time, float)


def test_transport_timeout_duration():
    cfg, _ = load_config([], ["transport.timeout=5m"])
    assert cfg.transport.timeout == 300.0


@pytest.mark.parametrize("value, seconds", [("90s", 90.0), ("24h", 86400.0), (" 2 m ", 120.0), (12, 12.0),
                                            (1.5, 1.5), ("3hr", 10800.0), ("4sec", 4.0)])
def test_parse_duration(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["soon", "10 years", "-5s", "", "1h30m", True])
def test_parse_duration_rejects(value):
    with pytest.raises(ValueError):
        parse_duration(value)


@pytest.mark.parametrize("seconds, text", [(90.0, "90s"), (3600.0, "1h"), (86400.0, "24h"), (120.0, "2m"), (0.5, "0.5s")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("empty", ["null", "~", "none", ""])
def test_null_clears_an_optional(tmp_path, empty):
    path = write(tmp_path, "cfg.yaml", "data:\n  max_docs: 5\nrun:\n  max_time: 1h\n  threads: 2\n")
    cfg, builder = load_config([path], [f"data.max_docs={empty}", f"run.max_steps={empty}", "run.threads=null"])
    assert cfg.data.max_docs is None
    assert cfg.run.max_steps is None and cfg.run.max_time == 3600.0
    assert cfg.run.threads is None
    assert builder.where("data.max_docs") == f"--set data.max_docs={empty}"


def test_null_in_file_clears_an_optional(tmp_path):
    path = write(tmp_path, "cfg.yaml", "run:\n  max_steps: null\n  max_time: 90s\n")
    cfg, _ = load_config([path])
    assert cfg.run.max_steps is None and cfg.run.max_time == 90.0


def test_set_value_may_contain_equals_sign():
    cfg, _ = load_config([], ["run.name=a=b"])
    assert cfg.run.name == "a=b"


@pytest.mark.parametrize("text, value", [("true", True), ("false", False), ("yes", True), ("off", False),
                                         ("on", True), ("no", False)])
def test_bool_spellings(text, value):
    cfg, _ = load_config([], [f"log.wandb={text}"])
    assert cfg.log.wandb is value


def test_integer_spellings():
    cfg, _ = load_config([], ["run.batch_size=32.0", "run.max_steps=1_000"])
    assert cfg.run.batch_size == 32 and isinstance(cfg.run.batch_size, int)
    assert cfg.run.max_steps == 1000


def test_log_progress_off_quoted_is_accepted():
    cfg, _ = load_config([], ["log.progress='off'"])
    assert cfg.log.progress == "off"


def test_log_progress_off_unquoted_is_accepted(tmp_path):
    cfg, _ = load_config([], ["log.progress=off"])
    assert cfg.log.progress == "off"
    path = write(tmp_path, "cfg.yaml", "log:\n  progress: off\n")
    cfg, _ = load_config([path])
    assert cfg.log.progress == "off"


def test_error_source_from_file_and_from_set(tmp_path):
    path = write(tmp_path, "cfg.yaml", "run:\n  batch_size: 10\n")
    msg = error_of([path], ["run.grad_accum=4"])
    # grad_accum came from --set: the message names that flag with its text
    assert msg.startswith("--set run.grad_accum=4: run.grad_accum: "), msg
    builder = ConfigBuilder()
    builder.apply_file(path)
    builder.apply_override("run.grad_accum=5")
    assert builder.where("run.batch_size") == path
    assert builder.where("run.grad_accum") == "--set run.grad_accum=5"
    assert builder.where("run.seed") == "default"


def test_dump_config_round_trips(tmp_path):
    cfg, _ = load_config([TINY], ["optim.betas=0.8,0.99", "run.max_time=90s", "run.max_steps=null",
                                  "data.max_docs=7", "model.tie_embeddings=false", "run.name=round trip",
                                  "compress.codec=fp32"])
    text = dump_config(cfg)
    data = yaml.safe_load(text)
    assert data["optim"]["betas"] == [0.8, 0.99]
    assert set(data) == set(SECTIONS)
    again = config_from_dict(data)
    assert again == cfg
    assert again.optim.betas == (0.8, 0.99) and again.run.max_time == 90.0 and again.run.max_steps is None
    builder = ConfigBuilder()
    builder.apply_mapping(data, "dump")
    assert builder.config == cfg
    assert builder.where("optim.lr") == "dump"
    # and as a file through load_config
    path = tmp_path / "config.yaml"
    path.write_text(text)
    from_file, _ = load_config([str(path)])
    assert from_file == cfg


def test_dump_of_defaults_round_trips():
    assert config_from_dict(yaml.safe_load(dump_config(Config()))) == Config()


def test_config_from_dict_reports_its_source():
    with pytest.raises(ConfigError, match=r"^checkpoint: optim\.lr: "):
        config_from_dict({"optim": {"lr": "fast"}})
    with pytest.raises(ConfigError, match=r"^mine: unknown section"):
        config_from_dict({"nope": {}}, source="mine")


def test_to_dict_betas_is_a_list():
    d = Config().to_dict()
    assert d["optim"]["betas"] == [0.9, 0.95]
    assert Config().optim.betas == (0.9, 0.95)  # the config itself is untouched


def test_builder_set_directly():
    b = ConfigBuilder()
    b.set("optim.lr", "2e-4", "code")
    assert b.config.optim.lr == 2e-4 and b.where("optim.lr") == "code"
    with pytest.raises(ConfigError, match=r"^code: unknown key 'optim.nope'"):
        b.set("optim.nope", 1, "code")


def test_every_field_has_documentation_and_is_described():
    text = describe_fields()
    for section, cls in SECTIONS.items():
        assert f"{section}:" in text
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{section}.{f.name} has no doc"
            assert f"  {f.name}: " in text
    assert "lr: 0.0004" in text and "Peak learning rate of the inner optimizer" in text


def test_defaults_do_not_share_mutable_state():
    a, b = Config(), Config()
    a.optim.lr = 1.0
    assert b.optim.lr == 4e-4


@pytest.mark.parametrize("preset", sorted(p.name for p in (Path(__file__).parent.parent / "configs").glob("*.yaml")))
def test_every_preset_loads_and_differs_from_defaults(preset, tmp_path, monkeypatch):
    import yaml

    path = Path(__file__).parent.parent / "configs" / preset
    folder = ((yaml.safe_load(path.read_text()) or {}).get("data") or {}).get("path")
    if folder:  # a preset on prepared shards names the folder loco data prepare makes, where loco runs
        monkeypatch.chdir(tmp_path)
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "manifest.json").write_text("{}")
    cfg, builder = load_config([str(path)])
    assert builder.sources
    own = {k for k, src in builder.sources.items() if src == str(path)}
    assert own, f"{preset} sets nothing of its own"
    # presets hold only differences: no key repeats its default, or the value of the preset it extends
    parent = (yaml.safe_load(path.read_text()) or {}).get("extends")
    base = load_config([str(path.parent / parent)])[0].to_dict() if parent else Config().to_dict()
    for key in own:
        section, name = key.split(".")
        assert cfg.to_dict()[section][name] != base[section][name], f"{preset}: {key} repeats what it extends"


def test_extends_layers_a_parent_file_and_refuses_cycles(tmp_path):
    write(tmp_path, "parent.yaml", "optim:\n  lr: 0.002\nrun:\n  seed: 4\n")
    child = write(tmp_path, "child.yaml", "extends: parent.yaml\nrun:\n  seed: 9\n")
    cfg, builder = load_config([child])
    assert cfg.optim.lr == 0.002 and cfg.run.seed == 9
    assert builder.where("optim.lr") == str((tmp_path / "parent.yaml").resolve())
    a = write(tmp_path, "a.yaml", "extends: b.yaml\n")
    write(tmp_path, "b.yaml", "extends: a.yaml\n")
    assert "cycle" in error_of([a])
    assert "not found" in error_of([write(tmp_path, "c.yaml", "extends: nope.yaml\n")])


def test_preset_names_resolve_to_the_configs_folder():
    cfg, _ = load_config(["simulate"])
    assert cfg.algo.name == "diloco" and cfg.data.seq_len == 128  # its own keys and tiny's


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("AUTO", "auto"), ("3", 3), ("null", None), (2, 2)])
def test_run_threads_takes_auto_a_number_or_empty(value, expected):
    if isinstance(value, int):  # a YAML number
        cfg = config_from_dict({"run": {"threads": value}})
    else:
        cfg, _ = load_config([], [f"run.threads={value}"])
    assert cfg.run.threads == expected
    assert Config().run.threads == "auto"


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_run_threads_refuses_other_values_in_one_line(value):
    with pytest.raises(ConfigError) as info:
        load_config([], [f"run.threads={value}"])
    text = str(info.value)
    assert "run.threads" in text and "\n" not in text, text


@pytest.mark.parametrize("cores, processes, omp, params, busy, threads, why", [
    (16, 1, None, 10_000_000, 0.0, 16, "16 core(s)"),
    (16, 4, None, 10_000_000, 0.0, 4, "16 core(s) shared by 4 processes"),  # torchrun's LOCAL_WORLD_SIZE
    (2, 4, None, 10_000_000, 0.0, 1, "2 core(s) shared by 4 processes"),
    (16, 1, "2", 10_000_000, 0.0, 2, "OMP_NUM_THREADS=2"),
    (4, 1, "8", 10_000_000, 0.0, 4, "4 core(s)"),  # never more than the cores
    (16, 1, None, 20_000, 0.0, 1, "a model under 32,768 parameters has nothing to split"),
    (16, 1, None, 100_000, 0.0, 16, "16 core(s)"),
    (8, 1, None, 10_000_000, 5.2, 3, "8 core(s), 5.2 of them kept busy by other work"),
    (2, 1, None, 10_000_000, 3.0, 1, "2 core(s), 3.0 of them kept busy by other work"),
])
def test_auto_threads_takes_a_share_of_the_idle_cores(cores, processes, omp, params, busy, threads, why):
    from launch.loop.runtime import auto_threads

    assert auto_threads(cores, processes, omp, params, busy) == (threads, why)


def test_a_deterministic_run_asks_torch_cublas_and_the_compiler_for_repeatable_kernels(monkeypatch):
    import os

    import torch
    import torch._inductor.config as inductor

    from launch.loop.runtime import start_process

    monkeypatch.setattr(inductor, "deterministic", False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    start_process(None, "cpu", deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    try:
        assert start_process(None, "cpu", deterministic=True) == torch.device("cpu")
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and inductor.deterministic
    finally:
        torch.use_deterministic_algorithms(False)
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def test_a_retired_key_is_said_in_one_line_naming_what_to_write_and_the_config_still_loads(tmp_path, capsys):
    path = write(tmp_path, "old.yaml", "run:\n  eval_batches: 8\n  max_steps: 5\n")
    cfg, _ = load_config([path], ["run.eval_batches=2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert cfg.run.max_steps == 5 and cfg.eval.tokens == 16384
    assert len(err) == 1 and "--set run.eval_batches=2: run.eval_batches is no longer read" in err[0]
    assert "write eval.tokens=N instead" in err[0]
    # a checkpoint's saved settings name it too: they load without a word
    from launch.config import config_from_dict

    assert config_from_dict({"run": {"eval_batches": 10}}).run.max_steps == 1000
    assert capsys.readouterr().err == ""


def test_a_key_the_chosen_algorithm_does_not_read_is_said_in_one_line_unless_a_preset_sets_it(tmp_path, capsys):
    load_config(["sparseloco"], [])  # inherits tiny's algo.outer_momentum: the preset's business
    assert capsys.readouterr().err == ""
    load_config(["sparseloco"], ["algo.outer_momentum=0.9"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("--set algo.outer_momentum=0.9: sparseloco does not read "
                                               "algo.outer_momentum (")
    mine = write(tmp_path, "mine.yaml", "extends: " + str(ROOT / "configs" / "tiny.yaml") +
                 "\nalgo:\n  name: diloco\n  fragments: 2\n")
    cfg, _ = load_config([mine], [])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{mine}: diloco does not read algo.fragments (")
    # a run's config.yaml records every key: resuming it says nothing
    saved = tmp_path / "config.yaml"
    saved.write_text(dump_config(load_config(["sparseloco"], [])[0]))
    load_config([str(saved)], [])
    assert capsys.readouterr().err == ""


def test_every_algorithm_declares_the_algo_keys_it_reads():
    from launch.config.algorithms import ALGORITHMS, reads

    keys = {f.name for f in dataclasses.fields(SECTIONS["algo"])}
    for name in ALGORITHMS:
        assert reads(name) is not None and reads(name) <= keys, name
