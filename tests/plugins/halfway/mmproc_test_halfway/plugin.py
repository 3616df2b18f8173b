"""The 'halfway' test plugin registers one architecture, then its hook raises."""

from mmproc import hookimpl


@hookimpl
def mmproc_register_models(registry):
    registry.register("HalfwayArch", "mmproc_test_halfway.model:Model")
    raise ValueError("halfway plugin gave up during registration")
