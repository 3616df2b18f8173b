"""mmproc's conformance suite on the midashenglm plugin (audio)."""

from mmproc.testing.suite import PluginConformance


class TestMiDashengLM(PluginConformance):
    plugin = "midashenglm"
    model = "demo:midashenglm"
    modality = "audio"
