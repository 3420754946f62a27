"""gem-kernels registers its backends and command lazily, with honest capabilities."""

import subprocess
import sys

from gem_core.registry import AutoContext, ImplementationSpec
from gem_kernels import plugin


def _collect(hook):
    specs: list[ImplementationSpec] = []
    hook(register=specs.append)
    return {spec.name: spec for spec in specs}


def test_attention_backends_are_registered():
    specs = _collect(plugin.gem_register_attention_backends)
    assert set(specs) == {"triton", "fbgemm", "torch-sdpa", "blocked"}
    assert specs["blocked"].devices == ("cpu", "cuda") and not specs["blocked"].requires
    assert specs["triton"].requires == ("triton",)
    assert specs["triton"].devices == ("cuda",)
    assert specs["fbgemm"].requires == ("fbgemm_gpu",)
    assert all(spec.supports_backward for spec in specs.values())


def test_triton_norm_is_registered_for_cuda():
    specs = _collect(plugin.gem_register_norm_backends)
    assert set(specs) == {"triton"} and specs["triton"].devices == ("cuda",)
    assert specs["triton"].load().name == "triton"
    assert plugin.gem_default_norm(AutoContext(device="cpu")) is None


def test_fbgemm_loads_to_a_backend():
    backend = _collect(plugin.gem_register_attention_backends)["fbgemm"].load()
    assert backend.name == "fbgemm"


def test_bench_command_is_registered_under_bench():
    specs = _collect(plugin.gem_register_cli_commands)
    command = specs["bench.attention"].load()
    assert command.name == "attention"


def test_importing_the_plugin_imports_neither_triton_nor_fbgemm():
    code = ("import sys, gem_kernels.plugin; "
            "print(sorted(m for m in ('triton', 'fbgemm_gpu') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_auto_picks_triton_on_cuda_and_blocked_on_cpu():
    name, reason = plugin.gem_default_attention(AutoContext(device="cpu"))
    assert name == "blocked" and "CPU" in reason
    name, reason = plugin.gem_default_attention(AutoContext(device="cuda"))
    assert name == "triton" and reason
