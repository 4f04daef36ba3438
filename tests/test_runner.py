"""The runner above a pure model (`qspec_core/runner/`): the model chooses no runner and keeps
none, runners keep their state to themselves, calibration runs the model with the runner off,
and no module of the core or the kernels holds mutable state."""

import ast
from pathlib import Path

import grimp
import pytest
import torch
from hf_tiny import ours_from_hf, tiny_hf

from kernels.cpu import build as cpu_ext
from kernels.cpu import linear as cpu_linear
from qspec_core.cache.full import FullPrecisionCache
from qspec_core.convert.convert import calibration_hessians
from qspec_core.model.ops import TORCH_OPS
from qspec_core.model.transformer import linear_layers
from qspec_core.precision import FP
from qspec_core.runner import CpuRunner, TorchRunner, build_runner

REPO = Path(__file__).resolve().parent.parent
native = pytest.mark.skipif(not cpu_ext.available(), reason="no C++ compiler here")


def _model():
    return ours_from_hf(tiny_hf("llama", seed=3))


def _forward(run, tokens, model):
    cache = FullPrecisionCache(model.config, 16, dtype=torch.float32)
    with torch.no_grad():
        return run(tokens, torch.arange(tokens.shape[1]), cache, FP)


def test_the_model_alone_runs_plain_pytorch_and_no_cpu_kernel(monkeypatch):
    """A Transformer called without a runner runs PyTorch's ops: no C++ kernel is loaded or
    called on its way (the attention here is the full-precision cache's, PyTorch too; the
    cache writes through its C++ side only once a runner has loaded the kernels), and it
    holds no runner. A step's rows, which a runner would send to the few-row kernels."""
    model = _model()
    tokens = torch.randint(0, 101, (1, 5), generator=torch.Generator().manual_seed(1))
    explicit = _forward(lambda *a: model(*a, ops=TORCH_OPS), tokens, model)

    def refuse(*args, **kwargs):
        raise AssertionError("the model reached a C++ kernel by itself")

    for name in ("load", "available"):
        monkeypatch.setattr(cpu_ext, name, refuse)
    monkeypatch.setattr(cpu_ext, "loaded", lambda: None)  # (a process no runner loaded them in)
    for name in ("linear", "int8_linear", "w8a8_linear", "int4_linear", "usable"):
        monkeypatch.setattr(cpu_linear, name, refuse)
    got = _forward(model, tokens, model)
    assert torch.equal(got, explicit)
    assert not any("runner" in name or "backend" in name for name in vars(model))
    assert "_apply" not in type(model).__dict__  # (no hook on .to(): the runtime rebuilds)


def test_the_model_package_imports_no_runner():
    graph = grimp.build_graph("qspec_core", "kernels", exclude_type_checking_imports=True)
    chain = graph.find_shortest_chain(importer="qspec_core.model", imported="qspec_core.runner")
    assert chain is None, chain
    for module in graph.find_children("qspec_core.model"):
        assert not graph.chain_exists(importer=module, imported="qspec_core.runner"), module


@native
def test_the_runner_is_chosen_at_build_by_device_and_the_stack_by_layer(monkeypatch):
    model = _model()
    assert isinstance(build_runner(model), CpuRunner)
    monkeypatch.setenv(cpu_ext.DISABLE_ENV, "0")  # (read when the runner is built)
    assert isinstance(build_runner(model), TorchRunner)
    qwen3 = ours_from_hf(tiny_hf("qwen3", head_dim=16))
    monkeypatch.delenv(cpu_ext.DISABLE_ENV)
    runner = build_runner(qwen3)  # (q/k norms: fields of the stack's layer)
    assert isinstance(runner, CpuRunner) and runner.stack("full") is not None
    tokens = torch.tensor([[7, 8, 9]])
    caches = [FullPrecisionCache(qwen3.config, 8, dtype=torch.float32) for _ in range(2)]
    with torch.no_grad():
        want = qwen3(tokens, torch.arange(3), caches[0])
        got = runner(tokens, torch.arange(3), caches[1])
    torch.testing.assert_close(got, want)


@native
def test_two_runners_of_one_model_share_nothing():
    model = _model()
    one, two = CpuRunner(model, cpu_ext.load()), CpuRunner(model, cpu_ext.load())
    tokens = torch.tensor([[7]])
    a, b = _forward(one, tokens, model), _forward(two, tokens, model)
    assert torch.equal(a, b)
    stack = one.stack("full")
    assert stack is not None and two.stack("full") is not stack
    two.rebuild()
    assert one.stack("full") is stack  # (one runner's rebuild leaves the other's alone)
    assert one.ops is not two.ops


@native
def test_calibration_runs_the_model_itself_with_its_hooks():
    """The runner never looks for hooks: a decode step on it runs the stack, and a hooked
    linear's hook does not fire. Calibration (`calibration_hessians`) runs the model itself,
    the runner off, so every linear's hook sees every position."""
    model = _model()
    runner = build_runner(model)
    seen = []
    layer = model.layers[0].mlp.gate_proj
    handle = layer.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    _forward(runner, torch.tensor([[7]]), model)
    assert seen == [] and runner.stack("full") is not None
    _forward(model, torch.tensor([[7]]), model)
    assert seen == [torch.Size([1, 1, 64])]
    handle.remove()
    hessians = calibration_hessians(model, list(range(3, 40)))
    assert hessians.keys() == linear_layers(model).keys()
    assert all(bool(h.abs().sum() > 0) for h in hessians.values())


# A module-level registry of built objects (the old `cpu_stack._STACKS`, a WeakKeyDictionary
# of C++ stacks by model) or a `global` rebinding is state a reader cannot see from a call.
# The one kept on purpose: the loaded C++ extension, which a process loads once per build
# (`kernels/cpu/build.py`: each ISA variant's module or failure, and the variant chosen).
ALLOWED = {"kernels/cpu/build.py": {"_module", "_failed", "_isa", "_variants", "_load_lock"}}
MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "WeakKeyDictionary",
                 "WeakValueDictionary", "WeakSet", "Lock", "RLock"}  # fmt: skip


def _mutable_state(path: Path) -> set[str]:
    """Names a module binds to a mutable container at import, or rebinds with `global`.
    UPPER_CASE displays (dicts, lists, sets written out) are tables of constants, and pass."""
    tree = ast.parse(path.read_text())
    found = {name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}
    for node in tree.body:
        if not isinstance(node, ast.Assign | ast.AnnAssign) or node.value is None:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        value = node.value
        func = value.func if isinstance(value, ast.Call) else None
        made = (
            isinstance(func, ast.Name | ast.Attribute)
            and (getattr(func, "id", None) or func.attr) in MUTABLE_CALLS
        )
        for name in (t.id for t in targets if isinstance(t, ast.Name)):
            table = (name.isupper() or name == "__all__") and not isinstance(value, ast.Call)
            if made or (isinstance(value, ast.Dict | ast.List | ast.Set) and not table):
                found.add(name)
    return found


def test_no_module_level_mutable_state_in_the_core_or_the_kernels():
    found = {}
    for path in sorted([*REPO.glob("qspec_core/**/*.py"), *REPO.glob("kernels/**/*.py")]):
        rel = str(path.relative_to(REPO))
        names = _mutable_state(path) - ALLOWED.get(rel, set())
        if names:
            found[rel] = sorted(names)
    assert not found, f"module-level mutable state: {found}"


def test_the_state_check_sees_what_it_should(tmp_path):
    """The check above fails on the old shapes of hidden state."""
    source = tmp_path / "old.py"
    source.write_text(
        "import weakref\n_STACKS = weakref.WeakKeyDictionary()\n_seen = {}\n"
        "TABLE = {'a': 1}\n_count = 0\ndef f():\n    global _count\n"
    )
    assert _mutable_state(source) == {"_STACKS", "_seen", "_count"}
