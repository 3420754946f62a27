"""Plugin contracts: checked when an implementation loads, declared capabilities enforced at
resolve, the order of ``auto`` answers, the attention start-up check, one table of kinds, and no
capability probing in the trainer."""

from __future__ import annotations

import ast
import contextlib
import types
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner

import gem_core
from gem_core import contracts, hookimpl
from gem_core.capabilities import SOFTMAX
from gem_core.config import BackendsConfig, ModelConfig
from gem_core.errors import GemConfigError, GemPluginError
from gem_core.kinds import KIND_TABLE, RUN_KINDS
from gem_core.plugins import build_plugins
from gem_core.registry import AutoContext, ImplementationSpec

GEM_CORE = Path(gem_core.__file__).parent


def _plugin(**hooks) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{name: hookimpl(fn) for name, fn in hooks.items()})


class _Recipe(contracts.PrecisionRecipe):
    """A complete recipe: everything but the required methods comes from the contract."""

    name = "test"

    def convert(self, model, ctx, options):
        return model

    def autocast(self, device_type):
        return contextlib.nullcontext()

    def mixed_precision_policy(self):
        return None


class _NoAutocast:
    """Looks like a recipe but lacks ``autocast`` and does not subclass the contract."""

    def convert(self, model, ctx, options):
        return model

    def mixed_precision_policy(self):
        return None


def _with(kind_hook: str, *specs: ImplementationSpec, name: str = "thirdparty", **more):
    def register(register):
        for spec in specs:
            register(spec)

    return build_plugins(load_entry_points=False,
                         extra_plugins=[(name, _plugin(**{kind_hook: register}, **more))])


def test_an_implementation_missing_a_required_method_fails_at_resolve_naming_it():
    plugins = _with("gem_register_precision_recipes",
                    ImplementationSpec(name="half-done", load=_NoAutocast))
    with pytest.raises(GemPluginError) as error:
        plugins.resolve("precision", "half-done", AutoContext(device="cpu"))
    message = str(error.value)
    assert "precision 'half-done' (plugin thirdparty" in message
    assert "gem_core.contracts.PrecisionRecipe" in message and "it lacks autocast" in message


def test_function_like_kinds_must_load_a_callable():
    plugins = _with("gem_register_batch_balancers",
                    ImplementationSpec(name="not-a-function", load=lambda: 42))
    with pytest.raises(GemPluginError, match="balancer 'not-a-function' .* not callable"):
        plugins.resolve("balancer", "not-a-function", AutoContext(device="cpu"))


def test_the_contract_supplies_the_optional_parts():
    recipe = _Recipe()
    assert recipe.calibration_batches_for(None) == 0 and recipe.summary() == {}
    assert recipe.calibrate(None, [], None, None) is None
    recipe.after_optimizer_step(None)
    with pytest.raises(NotImplementedError, match="asks for 2 calibration batches"):
        recipe.calibrate(None, [1, 2], None, None)


@pytest.mark.parametrize("declared, context, refusal", [
    (dict(devices=("cuda",)), AutoContext(device="cpu"), "does not run on cpu; it supports cuda"),
    (dict(dtypes=("float32",)), AutoContext(device="cpu", dtype="bfloat16"),
     "does not run under the precision recipe's activation dtype bfloat16"),
    (dict(supports_backward=False), AutoContext(device="cpu"), "has no backward"),
])
def test_declared_device_dtype_and_backward_are_enforced(declared, context, refusal):
    plugins = _with("gem_register_dense_sharding",
                    ImplementationSpec(name="narrow", load=lambda: None, **declared))
    with pytest.raises(GemConfigError, match=refusal):
        plugins.resolve("dense_sharding", "narrow", context)


def test_inference_accepts_what_has_no_backward():
    engine = _with("gem_register_dense_sharding", ImplementationSpec(
        name="forward-only", load=lambda: _SingleProcess(), supports_backward=False))
    resolved = engine.resolve("dense_sharding", "forward-only",
                              AutoContext(device="cpu", training=False))
    assert resolved.spec.name == "forward-only"


def _SingleProcess():
    from gem_core.single_process import SingleProcess

    return SingleProcess()


def test_auto_answers_are_asked_by_plugin_name_then_tryfirst_first():
    def answer(name):
        def default(context):
            return name, f"{name} says so"
        return default

    def register(register):
        for name in ("alpha", "beta"):
            register(ImplementationSpec(name=name, load=_SingleProcess))

    def build(beta_first: bool):
        beta = types.SimpleNamespace(gem_default_dense_sharding=hookimpl(
            answer("beta"), tryfirst=beta_first))
        alpha = _plugin(gem_register_dense_sharding=register,
                        gem_default_dense_sharding=answer("alpha"))
        # Registered in the opposite order of their names: registration order must not matter.
        return build_plugins(load_entry_points=False,
                             extra_plugins=[("p-beta", beta), ("p-alpha", alpha)])

    plugins = build(beta_first=False)
    assert plugins.default_answerers("dense_sharding") == ["p-alpha", "p-beta", "gem_core"]
    chosen = plugins.resolve("dense_sharding", "auto", AutoContext(device="cpu"))
    assert chosen.spec.name == "alpha" and chosen.reason == "auto: alpha says so"
    plugins = build(beta_first=True)
    assert plugins.default_answerers("dense_sharding")[0] == "p-beta"
    assert plugins.default_for("dense_sharding", AutoContext(device="cpu"))[0] == "beta"


def test_the_attention_backend_must_declare_what_the_model_needs():
    from gem_core.attention.choice import attention_needs, check_attention_backend

    model = ModelConfig(normalization="silu")
    assert attention_needs(model) == {"softmax": "model.target_attention (softmax attention)",
                                      "silu": "model.normalization = silu"}
    softmax_only = ImplementationSpec(name="soft", load=lambda: None, capabilities=(SOFTMAX,))
    both = ImplementationSpec(name="both", load=lambda: None, capabilities=("softmax", "silu"))
    check_attention_backend(model, both, [softmax_only, both])
    with pytest.raises(GemConfigError, match=r"'soft' does not support normalization silu "
                                             r"\(needed by model.normalization = silu\); "
                                             r"backends that do: both$"):
        check_attention_backend(model, softmax_only, [softmax_only, both])


def test_gem_train_refuses_a_softmax_only_backend_for_silu_at_start_up(tmp_path):
    from gem_core.cli.main import cli

    plugins = build_plugins()
    if "torch-sdpa" not in plugins.registry("attention"):
        pytest.skip("gem-kernels (torch-sdpa, softmax only) is not installed")
    silu = sorted(spec.name for spec in plugins.registry("attention").specs()
                  if "silu" in spec.capabilities)
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["train", "--out", str(out), "--attention", "torch-sdpa",
                                       "--set", "model.normalization=silu", "--no-progress"])
    assert result.exit_code != 0
    line = (f"attention backend 'torch-sdpa' does not support normalization silu (needed by "
            f"model.normalization = silu); backends that do: {', '.join(silu)}")
    assert result.output.strip().splitlines()[-1] == f"Error: {line}", result.output
    assert not (out / "metrics.jsonl").exists()  # refused before the first step


def test_every_registered_implementation_satisfies_its_contract():
    """Loading checks the contract: every installed implementation of every kind loads."""
    plugins = build_plugins()
    loaded = 0
    for kind in KIND_TABLE:
        for spec in plugins.registry(kind.name).specs():
            if spec.missing_requirements():
                continue
            impl = plugins.registry(kind.name).load(spec.name)
            if kind.contract is not None:
                assert isinstance(impl, kind.contract)
            loaded += 1
    assert loaded >= 30


def test_backends_config_cli_and_run_backends_follow_the_table_of_kinds():
    from gem_core.cli.train import train
    from gem_core.train.backends import RunBackends

    in_backends = {kind.config_key.split(".", 1)[1] for kind in RUN_KINDS
                   if kind.config_key.startswith("backends.")}
    assert {field.name for field in attrs.fields(BackendsConfig)} == in_backends
    assert [field.name for field in attrs.fields(RunBackends)] == [k.name for k in RUN_KINDS]
    flags = {opt for param in train.params for opt in param.opts}
    for kind in KIND_TABLE:
        if kind.cli_flag is not None:
            assert kind.cli_flag in flags, f"gem train has no {kind.cli_flag}"
            assert kind.config_key is not None
    # Every kind's config key names a field of the config with the value "auto" by default.
    from gem_core.config import load_config

    config = load_config(preset="tiny")
    for kind in RUN_KINDS:
        assert isinstance(kind.chosen_in(config), str)


def _probes(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{path.name}:{node.lineno} {node.func.id}()" for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("hasattr", "getattr")]


def test_the_trainer_does_not_probe_for_capabilities():
    """Optional parts are contract methods with defaults and capabilities are declared data:
    no hasattr/getattr in the training loop's package nor in parallelize()."""
    files = sorted((GEM_CORE / "train").glob("*.py")) + [GEM_CORE / "parallelize.py"]
    assert len(files) > 10
    found = [probe for path in files for probe in _probes(path)]
    assert found == [], f"capability probing: {found}"


def test_the_probe_scan_finds_probes(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f(x):\n    return hasattr(x, 'a') or getattr(x, 'b', None)\n")
    assert _probes(sample) == ["sample.py:2 hasattr()", "sample.py:2 getattr()"]
