"""Model class of the 'rival' test plugin."""

from mmproc import hookimpl


class RivalModel:
    @hookimpl
    def get_dummy_text(self, ctx, mm_counts):
        return "<rival>" * mm_counts.get("image", 0)
