"""One owner per concept: the algorithm registry and interface, and the layering the code promises."""

from __future__ import annotations

import ast
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import FAST, TINY
from diloco import ConfigConflict, DiLoCo, StreamingDiLoCo
from diloco.comm import Capabilities, LocalTransport
from launch.config.algorithms import ALGORITHMS, algorithm_class
from launch.config import ConfigError, load_config
from launch.models.transformer import Transformer, model_args_from_config
from launch.loop.build import build_algorithm, build_optimizer

ROOT = Path(__file__).resolve().parents[1]


def _cfg(*overrides):
    cfg, _ = load_config([TINY], [*FAST, *overrides])
    return cfg


def _built(*overrides, transport=None):
    cfg = _cfg(*overrides)
    torch.manual_seed(0)
    model = Transformer(model_args_from_config(cfg.model, 256, cfg.data.seq_len))
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"), transport=transport, cfg=cfg)
    return cfg, model, build_algorithm(cfg, model, opt, transport or LocalTransport(), tokens_per_step=64)


def test_one_registry_holds_every_algorithm():
    assert set(ALGORITHMS) >= {"ddp", "diloco", "streaming", "demo", "sparseloco"}
    with pytest.raises(ValueError, match="known: .*demo.*diloco"):
        algorithm_class("adam")


@pytest.mark.parametrize("name", ["ddp", "diloco", "streaming", "demo", "sparseloco"])
def test_from_config_builds_each_algorithm_with_its_settings(name):
    over = [f"algo.name={name}", "algo.inner_steps=7", "algo.outer_lr=0.3"]
    if name == "streaming":
        over += ["algo.fragments=2", "algo.overlap_steps=2"]
    if name == "ddp":
        over += ["compress.codec=int8"]
    _, _, algo = _built(*over)
    assert type(algo) is ALGORITHMS[name] and algo.name == name
    assert algo.round == 0 and algo.tokens_agreed == 0.0
    if name == "sparseloco":
        assert algo.gather and algo.codec.chain.startswith("topk:chunk=4096,k=82,ef=0.95,tile=64+2bit")
        assert algo.outer_optimizers[0].param_groups[0]["momentum"] == 0
    if name in ("diloco", "streaming", "sparseloco"):
        assert algo.policy.inner_steps == 7 and algo.outer_optimizers[0].param_groups[0]["lr"] == 0.3
        assert algo.tokens_per_step == 64
    if name == "streaming":
        assert len(algo.fragments) == 2 and algo.overlap_steps == 2
    if name == "ddp":
        assert algo.codec is not None and algo.codec.chain.startswith("int8")
    if name == "demo":
        from demo_optim import DeMo

        assert isinstance(algo.optimizer, DeMo)


def test_each_algorithm_states_its_own_constraints():
    with pytest.raises(ConfigConflict) as e:
        StreamingDiLoCo.check(2, 5, 0.0, "mix", 5, "steps")
    assert e.value.key == "algo.overlap_steps"
    # the same rule reaches the user through the config, naming the key
    with pytest.raises(ConfigError, match="algo.overlap_steps: 5 must be smaller than algo.inner_steps=5"):
        _cfg("algo.name=streaming", "algo.inner_steps=5", "algo.overlap_steps=5")
    with pytest.raises(ConfigError, match="compress.codec: DeMo sends its own"):
        _cfg("algo.name=demo", "compress.codec=int8")
    with pytest.raises(ConfigError, match="sync.mode: time-budgeted rounds need a round-based algorithm"):
        _cfg("algo.name=ddp", "sync.mode=time", "sync.time_budget_s=5s")


def test_shared_state_moves_the_global_model_and_outer_state_to_another_worker():
    _, model_a, a = _built("algo.name=diloco")
    _, model_b, b = _built("algo.name=diloco")
    with torch.no_grad():
        for g in b.global_params:
            g.add_(1.0)
        for opt in b.outer_optimizers:  # momentum worth carrying
            for p in opt.param_groups[0]["params"]:
                opt.state[p]["momentum_buffer"] = torch.full_like(p, 0.5)
    b.round, b.global_tokens = 3, 1234.0
    a.load_shared_state(b.shared_state())
    assert a.round == 3 and a.tokens_agreed == 1234.0 and a.round_steps == 0
    for ga, gb, p in zip(a.global_params, b.global_params, a.params):
        assert torch.equal(ga, gb) and torch.equal(p, gb)
    assert all(torch.equal(s["momentum_buffer"], torch.full_like(s["momentum_buffer"], 0.5))
               for s in a.outer_optimizers[0].state.values())
    bad = b.shared_state()
    bad["global_params"][0] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"shape \(3, 3\)"):
        a.load_shared_state(bad)


def test_to_moves_every_state_the_algorithm_keeps():
    """On a GPU machine this moves to CUDA; on CPU it checks the same invariants in place."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _, model, algo = _built("algo.name=streaming", "algo.fragments=4")
    assert any(rows is not None for _, rows in algo.pieces)  # row pieces: views of the global copy
    model(torch.randint(0, 256, (2, 16))).float().mean().backward()
    algo.step()
    algo.sync()  # inner and outer momentum exist
    algo.to(device)
    assert all(p.device.type == device.type for p in model.parameters())
    assert all(v.device.type == device.type for s in algo.optimizer.state.values() for k, v in s.items() if k != "step")
    fused = algo.optimizer.param_groups[0]["fused"]  # a fused kernel keeps the step count beside its parameter
    assert fused and all(s["step"].device.type == device.type for s in algo.optimizer.state.values())
    assert all(g.device.type == device.type for g in algo.global_params)
    assert all(v.device.type == device.type for o in algo.outer_optimizers for s in o.state.values() for v in s.values())
    assert algo.outer_device.type == device.type
    for view, (i, rows) in zip(algo.global_views, algo.pieces):  # the outer optimizers still step the global copy
        assert view.untyped_storage().data_ptr() == algo.global_params[i].untyped_storage().data_ptr()
    before = [g.detach().clone() for g in algo.global_params]
    x = torch.randint(0, 256, (2, 16), device=device)
    model(x).float().mean().backward()
    algo.step()
    algo.sync()
    assert all(not torch.equal(b, g) for b, g in zip(before, algo.global_params))

    _, _, kept = _built("algo.name=diloco", "algo.offload_outer=true")
    kept.to(device)
    assert all(g.device == torch.device("cpu") for g in kept.global_params)


def test_peers_without_fixed_ranks_average_through_the_codec_path():
    class NoRanks(LocalTransport):
        caps = Capabilities(fixed_ranks=False)

    _, _, algo = _built("algo.name=diloco", transport=NoRanks())
    assert algo.codec is not None and algo.codec.is_identity  # each update travels with its weight
    _, _, dense = _built("algo.name=diloco")
    assert dense.codec is None  # fixed ranks: the exact dense all-reduce


def test_a_robust_mean_writes_over_the_encoded_vector_unless_the_result_is_shared():
    """A peer's robust mean takes the vector it encoded as the mean's buffer (no second model-sized vector on its
    GPU); simulated members share the result, so theirs is a buffer of its own. The mean is right either way."""
    from diloco.compress.codec import make_codec
    from diloco.compress.robust import robust_mean

    class NoRanks(LocalTransport):
        caps = Capabilities(fixed_ranks=False)

    for shared in (False, True):
        transport = NoRanks()
        transport.caps = replace(transport.caps, shared_results=shared)
        x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
        flat = x.clone()
        result = robust_mean(transport, flat, make_codec("fp32"), 2.0, key=None)
        assert torch.equal(result.mean, x) and result.total == 2.0
        assert (result.mean.data_ptr() == flat.data_ptr()) == (not shared)


# ---- layering: imports point down only ---------------------------------------------------------
def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_all_gather_tensor_hands_over_the_tensors_and_counts_what_bytes_would():
    """The simulator's device all-gather passes each worker's tensor itself; through bytes (no device_gather) the
    same values arrive, and both count the same bytes."""
    from diloco.sim import InProcessGroup, run_workers

    def body(rank, transport):
        t = torch.arange(10, dtype=torch.uint8) + 10 * rank
        direct = transport.all_gather_tensor(t)
        sent = transport.stats.bytes_sent
        transport.caps = replace(transport.caps, device_gather=False)
        via_bytes = transport.all_gather_tensor(t)
        return direct, via_bytes, sent, transport.stats.bytes_sent - sent, direct[rank] is t

    for direct, via_bytes, sent, sent_again, same in run_workers(InProcessGroup(3), body):
        assert same and sent == sent_again == 20  # 10 bytes to each of the 2 others
        assert [x.tolist() for x in direct] == [x.tolist() for x in via_bytes] == [list(range(10 * r, 10 * r + 10))
                                                                                  for r in range(3)]


def test_layers_import_downwards_only():
    for path in _modules("diloco") + _modules("demo_optim"):
        assert not any(m.split(".")[0] == "launch" for m in _imports(path)), f"{path} imports launch/"
    for path in _modules("diloco"):
        assert not any(m.split(".")[0] == "demo_optim" for m in _imports(path)), f"{path} imports demo_optim"
    backends = ("torch.distributed", "hivemind")
    for path in _modules("diloco") + _modules("demo_optim") + _modules("launch"):
        if "comm" in path.relative_to(ROOT).parts:
            continue
        bad = [m for m in _imports(path) if m.startswith(backends)]
        assert not bad, f"{path} imports {bad}: only diloco/comm/ talks to a backend"


PACKAGES = ("diloco", "demo_optim", "launch")


def _import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project's modules it imports, wherever in the file (a function-local import that dodges a
    circle is still one). ``from package import name`` is an edge to the submodule ``name`` where there is one,
    else to the package's ``__init__``."""
    files = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                           for a in node.names]
            else:
                continue
            edges.update(t for t in targets if t in files and t != name)
        graph[name] = edges
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_through_others(tmp_path):
    assert _circles(_import_graph()) == []
    # the scan sees a circle made through a package's __init__ and one made by a function-local import
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "diloco/__init__.py").write_text("from diloco.a import x\n")
    (tmp_path / "diloco/a.py").write_text("from diloco import y\nx = 1\n")
    (tmp_path / "launch/b.py").write_text("def f():\n    from launch.c import g\n")
    (tmp_path / "launch/c.py").write_text("from launch.b import f\n")
    assert _circles(_import_graph(tmp_path)) == [["diloco", "diloco.a"], ["launch.b", "launch.c"]]


def _codec_imports(root: Path = ROOT) -> list[str]:
    """Every import of ``diloco.compress`` or a module in it by a module under ``diloco/comm/``, as "path: module"
    (one per import statement): wherever in the file (a function-local one too), absolute or relative, or as
    ``from diloco import compress``."""
    found = []
    for path in sorted((root / "diloco/comm").rglob("*.py")):
        package = list(path.relative_to(root).parent.parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                above = package[:len(package) - node.level + 1] if node.level else []
                base = ".".join(above + ([node.module] if node.module else []))
                names = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            codecs = [n for n in names if n == "diloco.compress" or n.startswith("diloco.compress.")]
            if codecs:
                found.append(f"{path.relative_to(root).as_posix()}: {codecs[0]}")
    return found


def test_the_transport_knows_bytes_not_codecs(tmp_path):
    # the collective builds on the transport, never the reverse: no module of the transports imports a codec
    assert _codec_imports() == []
    text = (ROOT / "diloco/comm/base.py").read_text()
    assert "encode(" not in text and "decode" not in text
    # the scan sees an import of the package or of a module in it, absolute, relative, or inside a function
    (tmp_path / "diloco/comm/hivemind").mkdir(parents=True)
    (tmp_path / "diloco/comm/base.py").write_text("from diloco.comm.caps import Capabilities\n")
    (tmp_path / "diloco/comm/a.py").write_text("from diloco import compress\n")
    (tmp_path / "diloco/comm/b.py").write_text("import diloco.compress.wire as wire\n")
    (tmp_path / "diloco/comm/hivemind/c.py").write_text("def f():\n    from diloco.compress.codec import Codec\n")
    (tmp_path / "diloco/comm/hivemind/d.py").write_text("from ...compress import wire\n")
    (tmp_path / "diloco/comm/hivemind/e.py").write_text("from .. import base\nfrom . import c\n")
    assert _codec_imports(tmp_path) == ["diloco/comm/a.py: diloco.compress", "diloco/comm/b.py: diloco.compress.wire",
                                        "diloco/comm/hivemind/c.py: diloco.compress.codec",
                                        "diloco/comm/hivemind/d.py: diloco.compress"]


def test_launch_never_imports_a_backend_module():
    for path in _modules("launch"):
        bad = [m for m in _imports(path) if m.startswith(("diloco.comm.hivemind", "diloco.comm.torch_dist",
                                                            "diloco.comm.node_mesh", "diloco.comm.fsdp"))]
        assert not bad, f"{path} imports {bad}: build transports with diloco.comm.make_transport"


def _from_modules(path: Path) -> set[str]:
    return {n.module for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}


def test_demo_uses_only_what_compress_exports():
    for path in _modules("demo_optim"):
        deep = [m for m in _from_modules(path) if m.startswith("diloco.compress.") and m != "diloco.compress.kernels"]
        assert not deep, f"{path} reaches into {deep} instead of what diloco.compress exports"


# the training loop and the rooms it holds: its wing, and rounds.jsonl
def _loop_modules() -> list[Path]:
    return [*_modules("launch/loop"), ROOT / "launch/metrics/rounds.py"]


def test_the_loop_never_asks_which_algorithm_runs():
    inside = {"global_params", "outer_optimizers", "policy", "global_tokens", "round_steps", "pieces", "global_views"}
    classes = {"DDP", "DiLoCo", "StreamingDiLoCo", "DeMo", "DeMoAlgorithm"}
    assert len(_loop_modules()) > 10
    for path in (*_loop_modules(), *_modules("launch/simulate"), *_modules("launch/join")):
        tree = ast.parse(path.read_text())
        attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)}
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        where = path.relative_to(ROOT)
        assert not (attrs & inside), f"{where} reaches into an algorithm: {attrs & inside}"
        assert not (names & classes), f"{where} names an algorithm class: {names & classes}"
    for path in _loop_modules():
        tree = ast.parse(path.read_text())
        named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in ALGORITHMS}
        assert not named, f"the loop dispatches on algorithm names in {path.relative_to(ROOT)}: {named}"


# ---- one owner for per-algorithm facts: launch/ asks the class, never the name ---------------------------------
_NAMES = frozenset({"ddp", "diloco", "streaming", "sparseloco", "demo"})


def _named_algorithms(node: ast.expr) -> set[str]:
    """The algorithm names ``node`` spells as string constants: one, or a tuple, list or set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & _NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_named_algorithms(e) for e in node.elts)) if node.elts else set()
    return set()


def _name_comparisons(source: str) -> list[tuple[int, set[str]]]:
    """(line, names) of each comparison (==, !=, in, not in) of something with an algorithm's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and all(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            names = set().union(*(_named_algorithms(e) for e in (node.left, *node.comparators)))
            if names:
                found.append((node.lineno, names))
    return found


def test_the_scan_finds_every_way_of_comparing_a_name():
    caught = ['cfg.algo.name == "streaming"', 'a.name in ("ddp", "demo")', 'name != "demo"',
              'setting.algo == "ddp"', 'x not in {"diloco", "sparseloco"}', '"ddp" == kind', 'n in ["demo"]']
    for text in caught:
        assert _name_comparisons(text), text
    for text in ('cfg.algo.name == other', 'x == "adamw"', 'Setting("ddp")', 'name = "ddp"', 'a < "ddp"'):
        assert not _name_comparisons(text), text


def test_launch_never_compares_an_algorithm_name():
    """What an algorithm is (round-based, fragmented, the baseline, fit for a swarm, what peers share, how a
    run of it is labelled) is declared on its class; launch/ asks the class through the registry."""
    for path in _modules("launch"):
        found = _name_comparisons(path.read_text())
        assert not found, f"{path.relative_to(ROOT)} compares algorithm names: {found}"


# ---- rooms of one job: sizes, the loop's module, probes --------------------------------------------------------
def _package_files(root: Path) -> list[Path]:
    return [path for package in PACKAGES for path in sorted((root / package).rglob("*.py"))]


def _planted(root: Path, files: dict[str, str]) -> Path:
    """A tree of the three packages holding ``files`` (path -> text): where a guard must find its breach."""
    for package in PACKAGES:
        (root / package).mkdir()
    for name, text in files.items():
        (root / name).write_text(text)
    return root


ROOM_LINES = 500  # a module past this is a sign to split it
TRAINER_LINES = 350  # the loop's module: what a step does and what follows it, nothing else


def _too_long(root: Path) -> list[str]:
    """Every module of the three packages past ``ROOM_LINES``, and the module defining ``Trainer`` at or past
    ``TRAINER_LINES``."""
    found = []
    for path in _package_files(root):
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > ROOM_LINES:
            found.append(f"{path.relative_to(root)}: {lines} lines")
        if re.search(r"^class Trainer\b", text, re.M) and lines >= TRAINER_LINES:
            found.append(f"{path.relative_to(root)} defines Trainer in {lines} lines")
    return found


def test_no_module_outgrows_its_room(tmp_path):
    assert _too_long(ROOT) == []
    planted = _planted(tmp_path, {"diloco/big.py": "x = 1\n" * (ROOM_LINES + 1),
                                  "launch/loop.py": "class Trainer:\n" + "    x = 1\n" * TRAINER_LINES,
                                  "demo_optim/fine.py": "x = 1\n" * ROOM_LINES})
    assert _too_long(planted) == [f"diloco/big.py: {ROOM_LINES + 1} lines",
                                   f"launch/loop.py defines Trainer in {TRAINER_LINES + 1} lines"]


def test_launch_is_a_few_wings():
    """``launch/`` holds its wings (packages by job), the entry points, the one error and the re-exported loop."""
    entries = sorted(p.name for p in (ROOT / "launch").iterdir() if p.name != "__pycache__")
    assert len(entries) <= 15, entries
    loose = [e for e in entries if e.endswith(".py")]
    assert loose == ["__init__.py", "__main__.py", "errors.py", "trainer.py"], loose


# Probes on objects that are not loco's: their attribute differs by library version or by subcommand
FOREIGN = {
    ("diloco/comm/hivemind/registry.py", "v"): "a value hivemind's DHT returns",
    ("diloco/extras.py", "e"): "an ImportError",
    ("launch/cli/commands.py", "args"): "argparse's namespace: each subcommand has its own flags",
    ("launch/loop/runtime.py", "inductor"): "torch's inductor config, whose keys differ by torch version",
}


def _declared_names(root: Path) -> set[str]:
    """Every attribute and method a class of the three packages declares (defines, assigns on self, or names in
    its body)."""
    names = set()
    for path in _package_files(root):
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(node.name)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names.add(node.target.id)
                elif isinstance(node, ast.Assign):
                    names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            for node in ast.walk(cls):
                if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                        and isinstance(node.value, ast.Name) and node.value.id == "self"):
                    names.add(node.attr)
    return names - {"__init__"}


def _probes(root: Path) -> list[str]:
    """``hasattr(x, "name")`` and ``getattr(x, "name", default)`` where a class of loco's declares ``name``: a
    question an interface should answer. Probes on the objects in ``FOREIGN`` are not counted."""
    declared = _declared_names(root)
    found = []
    for path in _package_files(root):
        where = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("hasattr", "getattr") and len(node.args) >= 2):
                continue
            name = node.args[1]
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                continue
            if node.func.id == "getattr" and len(node.args) == 2:  # no default: an attribute by name, not a probe
                continue
            if name.value in declared and (where, ast.unparse(node.args[0])) not in FOREIGN:
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return found


def test_loco_asks_its_own_objects_through_interfaces(tmp_path):
    assert _probes(ROOT) == []
    planted = _planted(tmp_path, {
        "launch/batches.py": "class Batcher:\n    def close(self):\n        pass\n",
        "launch/loop.py": "def end(batcher, args):\n    if hasattr(batcher, 'close'):\n        batcher.close()\n"
                          "    return getattr(args, 'close', None), getattr(args, 'seed', 0)\n"})
    assert _probes(planted) == ["launch/loop.py:2 hasattr(batcher, 'close')",
                                 "launch/loop.py:4 getattr(args, 'close', None)"]


def test_dtensor_checks_go_through_comm():
    """Whether a tensor is a DTensor, and its local part, are asked of one helper in ``diloco/comm/``, the room
    that alone imports ``torch.distributed``."""
    for path in _modules("diloco") + _modules("demo_optim") + _modules("launch"):
        if "comm" in path.relative_to(ROOT).parts:
            continue
        text = path.read_text()
        bad = [w for w in ('"to_local"', "'to_local'", '"device_mesh"', "'device_mesh'") if w in text]
        assert not bad, f"{path.relative_to(ROOT)} probes a DTensor by {bad}: use diloco.comm's helper"


def _private_imports(root: Path) -> list[str]:
    """``from <one of loco's modules> import _name``: a name its module keeps to itself, taken by another."""
    found = []
    for path in _package_files(root):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.split(".")[0] in PACKAGES):
                found += [f"{path.relative_to(root)}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_takes_a_name_private_to_another(tmp_path):
    assert _private_imports(ROOT) == []
    planted = _planted(tmp_path, {"diloco/a.py": "def _inner():\n    pass\n",
                                  "launch/b.py": "from diloco.a import _inner\nfrom diloco import __version__\n"})
    assert _private_imports(planted) == ["launch/b.py: diloco.a._inner"]


def test_the_names_users_and_scripts_rely_on_import():
    """What the README, scripts and ``pyproject.toml``'s entry point name, wherever the code behind them lives."""
    import diloco
    from diloco import DiLoCo as named
    from diloco.comm import make_transport
    from launch.cli import main
    from launch.config import load_config
    from launch.loop.trainer import train as loop_train
    from launch.trainer import train

    assert train is loop_train and callable(main) and callable(load_config) and callable(make_transport)
    assert named is diloco.ALGORITHMS["diloco"]
    assert (ROOT / "launch/__main__.py").is_file() and (ROOT / "launch/cli/__main__.py").is_file()  # python -m


# launch's wings, from the top: a wing imports only the wings below it
WINGS = (("cli",), ("plan",), ("simulate", "join"), ("trainer",), ("loop",), ("eval",), ("metrics",), ("config",), ("models",),
         ("data",), ("store",), ("errors",))


def _wing_arrows_up(root: Path) -> list[str]:
    floor = {wing: i for i, wings in enumerate(WINGS) for wing in wings}
    found = []
    for path in sorted((root / "launch").rglob("*.py")):
        parts = path.relative_to(root / "launch").with_suffix("").parts
        mine = floor.get(parts[0])
        if mine is None:  # launch/__init__.py and __main__.py stand above every wing
            continue
        wings = {t.split(".")[1] for t in _imports(path) if t.startswith("launch.") and t.split(".")[1] in floor}
        found += [f"{path.relative_to(root)} imports launch.{w}" for w in sorted(wings)
                  if w != parts[0] and floor[w] <= mine]
    return found


def test_launch_wings_import_downwards(tmp_path):
    assert _wing_arrows_up(ROOT) == []
    planted = _planted(tmp_path, {})
    (planted / "launch/models").mkdir()
    (planted / "launch/models/sample.py").write_text("from launch.loop.runtime import resolve_device\n")
    (planted / "launch/loop").mkdir()
    (planted / "launch/loop/trainer.py").write_text("from launch.models.base import RunModel\n")
    assert _wing_arrows_up(planted) == ["launch/models/sample.py imports launch.loop"]
