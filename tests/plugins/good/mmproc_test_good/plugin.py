"""Registration module of the 'good' test plugin: light, imports no model code."""

from mmproc import hookimpl


@hookimpl
def mmproc_register_models(registry):
    registry.register(["GoodModelForTest", "SharedArch"], "mmproc_test_good.model:GoodModel")
    # Registering the same thing twice is a no-op.
    registry.register("GoodModelForTest", "mmproc_test_good.model:GoodModel")
