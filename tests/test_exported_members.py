"""The public names: what `import loramux` and `loramux.errors` export is pinned, resolves, and every
public error class is defined in loramux.errors (no error type hiding in a feature module)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import loramux
import loramux.errors as errors

PUBLIC = {
    "AdapterError", "AdapterNotFoundError", "BackendError", "CancelToken", "ChecksumError", "Completion",
    "ContextLengthError", "ControlVector", "ControlVectorError", "ConversionError", "DownloadCancelled",
    "DownloadError", "Engine", "EngineOptions", "FactorError", "LoRAAdapter", "LoraSpec", "LoramuxError",
    "Model", "ModelError", "ParameterError", "SamplingParams", "Source", "SourceError", "TextStream",
    "TrainingError", "convert_peft", "default_model_path", "drift", "export_peft", "merge", "probe",
    "resolve", "train_zo",
}
ERRORS = {
    "AdapterCapacityError", "AdapterDirError", "AdapterError", "AdapterNotFoundError", "AdapterVersionError", "BackendError", "ChecksumError", "ContextLengthError",
    "ControlVectorError", "ConversionError", "DownloadCancelled", "DownloadError", "DownloadRefused",
    "EngineClosedError", "FactorError", "FactorStateError", "GGUFFormatError", "GrammarBudgetError", "LoramuxError",
    "ModelError",
    "PackageDataError",
    "ParameterError",
    "ProbeMismatch", "RequestFailed", "RpcError", "ScaleError", "ServerError", "SlotsBusyError", "SourceError",
    "TrainingError", "ChatTemplateError", "GrammarError", "GrammarSyntaxError",
}


def test_package_exports_are_pinned_and_resolve():
    assert set(loramux.__all__) == PUBLIC
    for name in loramux.__all__:
        assert getattr(loramux, name) is not None, name


def test_error_exports_are_pinned():
    assert set(errors.__all__) == ERRORS
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.LoramuxError), name
        assert cls.__module__ == "loramux.errors", name
        assert isinstance(cls.code, str) and cls.code, name


def test_every_error_class_lives_in_errors():
    """Import every module of the package; any LoramuxError subclass must come from loramux.errors."""
    strays = []
    for info in pkgutil.walk_packages(loramux.__path__, "loramux."):
        if info.name.endswith("__main__"):
            continue
        mod = importlib.import_module(info.name)
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and issubclass(obj, errors.LoramuxError) and obj.__module__ == info.name:
                if info.name != "loramux.errors":
                    strays.append(f"{info.name}.{name}")
    assert strays == []


def test_no_module_imports_another_modules_private_name():
    """`from x import _name` across modules is a missing public API (DESIGN §3)."""
    import ast
    from pathlib import Path

    root = Path(loramux.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("loramux")):
                for alias in node.names:
                    # `_native` is the ctypes boundary module itself, not a private name of another module
                    if alias.name.startswith("_") and alias.name not in ("_native", "__version__"):
                        found.append(f"{path.relative_to(root)}: from {'.' * node.level}{node.module or ''} "
                                     f"import {alias.name}")
    assert found == []
