// CUDA hooks for the CUDA stand-in (tests/support/fakecuda.py), so that autograd's backward
// pass runs on its "cuda" tensors. torch's autograd engine asks the accelerator (at::getAccelerator,
// from the CUDA hooks) for the stream of each "cuda" gradient, and a CPU-only build has no CUDA
// hooks: "Cannot access accelerator device when none is available". These say CUDA is there, with
// the do-nothing device guard of fakecuda_guard.cpp. torch looks the hooks up once, at its first
// question, so this library must be loaded before torch is (LD_PRELOAD: fakecuda.autograd_env),
// and it registers anything only in a process started with KVJ_FAKECUDA_AUTOGRAD set (the number
// of devices): loaded any other way it does nothing.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

#include <cstdlib>
#include <memory>

namespace kvj_standin {

using Guard = c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>;

const c10::impl::DeviceGuardImplInterface* guard() {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
}

struct StandInHooks : at::CUDAHooksInterface {
  explicit StandInHooks(c10::DeviceIndex devices) : devices_(devices) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return devices_; }
  c10::DeviceIndex getCurrentDevice() const override { return guard()->getDevice().index(); }
  void setCurrentDevice(c10::DeviceIndex d) const override {
    guard()->setDevice(c10::Device(c10::DeviceType::CUDA, d));
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    return guard()->exchangeDevice(c10::Device(c10::DeviceType::CUDA, d)).index();
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }

 private:
  c10::DeviceIndex devices_;
};

const bool registered = [] {
  const char* devices = std::getenv("KVJ_FAKECUDA_AUTOGRAD");
  if (devices == nullptr) {
    return false;
  }
  static Guard fake_guard;
  static c10::impl::DeviceGuardImplRegistrar guard_registrar(c10::DeviceType::CUDA, &fake_guard);
  const auto n = static_cast<c10::DeviceIndex>(std::atoi(devices));
  at::CUDAHooksRegistry()->Register(
      "CUDAHooks", [n](at::CUDAHooksArgs) -> std::unique_ptr<at::CUDAHooksInterface> {
        return std::make_unique<StandInHooks>(n);
      });
  return true;
}();

}  // namespace kvj_standin
