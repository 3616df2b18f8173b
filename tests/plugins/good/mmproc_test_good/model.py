"""Model class of the 'good' test plugin (imported only on lookup)."""

from mmproc import hookimpl


class GoodModel:
    @hookimpl
    def get_dummy_text(self, ctx, mm_counts):
        return "<img>" * mm_counts.get("image", 0)

    @hookimpl
    def get_mm_fields(self, ctx, outputs):
        return {}

    @hookimpl
    def get_prompt_updates(self, ctx, mm_items, item_outputs):
        return []

    @hookimpl
    def worker_count_hint(self, ctx, path):
        return 3

    @hookimpl
    def supports_concurrency(self):
        return False
