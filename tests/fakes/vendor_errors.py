"""How the real stack reports a rejected call, so the fake raises the same way.

* op-plugin argument checks are ``TORCH_CHECK(cond, msg + OPS_ERROR(code))``: a RuntimeError
  carrying the vendor's message (Ascend/op-plugin ``op_plugin/ops/opapi/*.cpp``).
* aclnn parameter checks fail ``aclnnXxxGetWorkspaceSize``; ``EXEC_NPU_CMD`` then raises through
  ``NPU_CHECK_ERROR(workspace_status, "call " #aclnn_api " failed")`` (op-plugin
  ``op_plugin/utils/op_api_common.h``); the OP_LOGE text of the check is in the error detail.
* A kernel missing from the CANN install: ``check_aclnn_kernel_available`` (dlsym of
  ``aclnnXxx`` and ``aclnnXxxGetWorkspaceSize`` in libopapi.so) picks another version, or
  ``EXEC_NPU_CMD`` raises "<api> or <api>GetWorkspaceSize not in libopapi.so, or libopapi.so
  not found." (same header).
Binding errors (wrong argument names or types) come from torch itself: the fake registers the
real schemas with ``torch.library`` so torch raises exactly as it does for ``torch.ops.npu``.
"""
from __future__ import annotations


class FakeNotModelledError(NotImplementedError):
    """A call the real op may accept but this fake does not model (e.g. FP4, int8 outputs):
    raised instead of guessing numbers."""


def torch_check(cond: bool, message: str) -> None:
    """op-plugin ``TORCH_CHECK``: RuntimeError with the vendor message when ``cond`` is false."""
    if not cond:
        raise RuntimeError(message)


def aclnn_check(cond: bool, api: str, message: str) -> None:
    """An aclnn GetWorkspaceSize / tiling check: RuntimeError "call <api> failed, detail: ..."."""
    if not cond:
        raise RuntimeError(f"call {api} failed, detail: {message}")


def missing_kernel(api: str) -> RuntimeError:
    """The error EXEC_NPU_CMD raises when the aclnn symbol is not in the CANN install."""
    return RuntimeError(f"{api} or {api}GetWorkspaceSize not in libopapi.so, or libopapi.so not found.")


def not_modelled(what: str) -> FakeNotModelledError:
    return FakeNotModelledError(f"fake torch_npu: {what} is not modelled (see tests/fakes/README.md)")
