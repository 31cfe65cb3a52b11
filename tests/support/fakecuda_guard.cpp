// The CUDA device guard of the CUDA stand-in (tests/support/fakecuda.py), for CPU-only torch
// builds, which register none: torch's Python bindings (copy_, indexing, item) and autograd
// set a device guard before an op on a "cuda" tensor reaches the stand-in's dispatch, and
// without one they fail ("PyTorch is not linked with support for cuda devices") or abort.
// torch's own FakeGuardImpl keeps the current device and stream ids per thread and does nothing.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace kvj_standin {
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
}
