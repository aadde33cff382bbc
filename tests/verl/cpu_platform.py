"""A CPU platform for verl (verl has none: without an accelerator it falls back to CUDA),
registered through verl's own plugin mechanism (`PlatformRegistry.register`, `set_platform`).
`install()` must run before `verl.workers.engine` is imported: transformer_impl reads the
device name at import."""
from contextlib import contextmanager

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry, set_platform


@PlatformRegistry.register(platform="cpu")
class CPUPlatform(PlatformBase):
    """The device is "cpu" (what `.to(get_device_id())` and the meshes use), the backend gloo;
    memory, seeds of other devices, profiling and IPC are no-ops or absent."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = torch.cpu

    def is_available(self):
        return True

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


def install():
    set_platform(CPUPlatform())
    # verl's LoRA weight collection empties its device module's cache, which torch.cpu lacks;
    # verl compares the module with torch.cpu elsewhere, so it stays torch.cpu.
    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None
