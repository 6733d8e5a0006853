"""``te_npu.compat`` holds every private torch name te_npu uses: pinned to the torch it was read
against, each name present, FSDP2's internals readable on a live unit, and nothing else in the
package touching ``torch._C`` or FSDP2's private modules."""
from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import socket

import pytest
import torch
from torch import nn

from te_npu import compat

PACKAGE = pathlib.Path(compat.__file__).parent


def test_compat_pinned_to_tested_torch():
    installed = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert installed == compat.TESTED_TORCH, (
        f"torch {torch.__version__} is installed; te_npu/compat.py was checked against torch "
        f"{compat.TESTED_TORCH}: re-read each private name it uses ({[n for _, n in compat.PRIVATE_NAMES]}, "
        "the FSDP2 attributes in its docstring) in this release, then bump TESTED_TORCH"
    )


@pytest.mark.parametrize("module_name, dotted", compat.PRIVATE_NAMES, ids=[f"{m}:{n}" for m, n in compat.PRIVATE_NAMES])
def test_compat_private_name_exists(module_name, dotted):
    obj = importlib.import_module(module_name)
    for part in dotted.split("."):
        assert hasattr(obj, part), f"torch {torch.__version__}: {module_name}.{dotted} is gone (te_npu/compat.py uses it)"
        obj = getattr(obj, part)


def test_compat_graph_task_id_is_minus_one_outside_backward_and_set_inside():
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append((compat.current_graph_task_id(), compat.in_autograd_backward())))
    y.sum().backward()
    assert compat.current_graph_task_id() == -1 and not compat.in_autograd_backward()
    assert len(seen) == 1 and seen[0][0] != -1 and seen[0][1] is True


def test_compat_non_persistent_buffer_names():
    module = nn.Module()
    module.register_buffer("kept", torch.zeros(1))
    module.register_buffer("dropped", torch.zeros(1), persistent=False)
    assert compat.non_persistent_buffer_names(module) == {"dropped"}


def test_compat_fsdp_internals_readable_on_a_live_unit():
    """One gloo rank: a unit whose parameter lives in a child module, as in a decoder-layer unit."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        layer = nn.Sequential(nn.Linear(4, 4, bias=False))
        model = nn.Sequential(layer)
        fully_shard(layer)
        fully_shard(model)
        owner, shard = layer[0], compat.local_tensor(layer[0].weight)
        assert shard is not layer[0].weight.to_local()  # public to_local(): a view
        in_backward = []
        y = model(torch.ones(2, 4, requires_grad=True))  # lazy init names the parameters
        y.register_hook(lambda g: in_backward.append(compat.fsdp_param_info(shard, owner)))
        y.sum().backward()  # the hook runs after FSDP's pre-backward hook on the same output
        assert compat.fsdp_param_info(torch.zeros(1), owner) is None  # not a managed shard
        info = compat.fsdp_param_info(shard, owner)
        assert info is not None and info.param_fqn == "0.0.weight"
        assert info.reshard_after_forward and not info.group_unsharding_for_backward
        assert len(in_backward) == 1 and in_backward[0].group_unsharding_for_backward
        assert compat.fsdp_param_info(shard, owner) == info  # the cached lookup finds the same
        fsdp_param = info._fsdp_param
        assert isinstance(fsdp_param, FSDPParam) and isinstance(fsdp_param.all_gather_outputs, list)
        fsdp_param.all_gather_outputs = [torch.empty(16)]
        compat.fit_all_gather_outputs(info, (torch.empty(16),), 1)
        assert len(fsdp_param.all_gather_outputs) == 1  # fits: kept
        compat.fit_all_gather_outputs(info, (torch.empty(8), torch.empty(8)), 1)
        assert fsdp_param.all_gather_outputs == []  # does not fit: FSDP reallocates
        # FSDP2 frees the unsharded parameter's inner tensors through this attribute
        assert "_unsharded_inner_tensors" in inspect.getsource(FSDPParam.free_unsharded_param)
    finally:
        dist.destroy_process_group()


def _private_torch_touches(path: pathlib.Path) -> list[str]:
    """``torch.…._x`` attribute chains and ``from torch…_x import`` lines in one source file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            private = [a.name for a in node.names if a.name.startswith("_")]
            if any(part.startswith("_") for part in node.module.split(".")) or private:
                found.append(f"{path.name}:{node.lineno} from {node.module} import {[a.name for a in node.names]}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in ("torch", "dist") and "ops" not in chain:
                found.append(f"{path.name}:{node.lineno} {value.id}.{'.'.join(reversed(chain))}")
    return found




def test_no_private_torch_name_outside_compat():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "compat.py":
            continue
        offenders += _private_torch_touches(path)
    assert offenders == [], "private torch names belong in te_npu/compat.py:\n" + "\n".join(offenders)


def test_no_torch_C_outside_compat():
    """The issue's grep: ``torch._C`` appears in no te_npu source but the compat module."""
    hits = [f"{p.relative_to(PACKAGE)}:{i}" for p in sorted(PACKAGE.rglob("*.py")) if p.name != "compat.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if "torch._C" in line]
    assert hits == []
