"""Model classes with hook mistakes a plugin author could make."""

from mmproc import hookimpl


class MisspelledHook:
    @hookimpl
    def get_promt_updates(self, ctx, mm_items, item_outputs):
        return []


class WrongArgument:
    @hookimpl
    def get_dummy_text(self, ctx, counts):
        return ""


class UnmarkedHook:
    def get_dummy_text(self, ctx, mm_counts):
        return ""
