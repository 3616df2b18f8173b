"""Model classes with hook mistakes a plugin author could make."""

from mmproc import hookimpl


class Complete:
    """The required hooks, so that each class below has exactly one mistake."""

    @hookimpl
    def get_dummy_text(self, ctx, mm_counts):
        return ""

    @hookimpl
    def get_mm_fields(self, ctx, outputs):
        return {}

    @hookimpl
    def get_prompt_updates(self, ctx, mm_items, item_outputs):
        return []


class MisspelledHook(Complete):
    @hookimpl
    def get_promt_updates(self, ctx, mm_items, item_outputs):
        return []


class WrongArgument(Complete):
    @hookimpl
    def get_dummy_text(self, ctx, counts):
        return ""


class UnmarkedHook(Complete):
    def get_dummy_text(self, ctx, mm_counts):
        return ""


class MissingHook:
    @hookimpl
    def get_dummy_text(self, ctx, mm_counts):
        return ""
