"""The registry's aliases and the bar a version must pass to be served: the names every module
(registry, index, retrain, CLI) uses. Imports nothing, so the CLI builds its help from it.

- ``champion``: the version a consumer loads (``models:/NAME@champion``);
- ``previous-champion``: the champion it replaced, so one command restores it;
- ``serving``: the version ``proxydml search`` and ``serve`` answer with, one whose published
  index reaches :data:`SERVING_MIN_RECALL` (a rollback moves it with the champion).
"""

CHAMPION = "champion"
PREVIOUS = "previous-champion"
SERVING = "serving"
# ANN recall@10 against exact search that a version's index needs before `serving` moves to it.
SERVING_MIN_RECALL = 0.95
