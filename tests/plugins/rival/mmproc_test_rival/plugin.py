"""The 'rival' test plugin claims an architecture the 'good' one serves too."""

from mmproc import hookimpl


@hookimpl
def mmproc_register_models(registry):
    registry.register("SharedArch", "mmproc_test_rival.model:RivalModel")
