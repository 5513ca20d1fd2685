"""A heavy module imported on first use: `--help` and flag errors answer before torch loads."""
import importlib
import types


class LazyModule(types.ModuleType):
    """Stands in for module `name` in `namespace` (a module's globals()); the first attribute read
    imports the real module and puts it in the stand-in's place."""

    def __init__(self, name: str, namespace: dict):
        super().__init__(name)
        self._namespace = namespace

    def __getattr__(self, attr):
        module = importlib.import_module(self.__name__)
        self._namespace[self.__name__] = module
        return getattr(module, attr)
