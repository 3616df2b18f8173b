"""The 'typo' test plugin registers model classes whose hooks do not match the specs."""

from mmproc import hookimpl


@hookimpl
def mmproc_register_models(registry):
    registry.register("MisspelledHookModel", "mmproc_test_typo.model:MisspelledHook")
    registry.register("WrongArgumentModel", "mmproc_test_typo.model:WrongArgument")
    registry.register("UnmarkedHookModel", "mmproc_test_typo.model:UnmarkedHook")
    registry.register("MissingHookModel", "mmproc_test_typo.model:MissingHook")
