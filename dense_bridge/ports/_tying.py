"""Tied parameters as each library's loader makes them: a twin built as its loader would load it.

Some libraries decide by the files, not the config, whether a parameter is tied to another: a
loader that finds no output head computes with the embedding's transpose, and builds the model
without the head. The port's twins are built from configs, so they hold every parameter; these
hooks make them what the loaders make of the files at hand (through the format's optional verb
``port_as_loaded(fmt, model, names) -> parameter names``; formats without it are left as built):

- the source twin is made what its loader makes of files holding the real source's tensors
  (:func:`source_twin`): a head the source does not store is tied in the twin too;
- a destination tensor that only repeats a source tensor another destination tensor already
  holds whole (a tied source's embedding written again as the head) is not written when the
  destination's loader builds its model without it (:func:`drop_copies`): the destination ties it,
  as its own loader does for the source.
"""
from __future__ import annotations

from . import _dirs, _rules


def source_twin(fmt, model, shapes: dict, stored) -> object:
    """``model`` (the source twin, parameters ``shapes``) made what ``fmt``'s loader makes of files
    holding the tensors whose templates the real source stores (``stored``: its file keys).

    Args:
        fmt: the source's format.
        model: its twin, changed in place where the loader drops parameters.
        shapes: {parameter: shape} of the twin (``port_shapes`` of its config).
        stored: the real source's tensor names.
    Returns:
        ``model``.
    """
    fn = _dirs.optional(fmt, "port_as_loaded")
    if fn is None or stored is None:
        return model
    kept = {_rules.template(k)[0] for k in stored}
    names = {k for k in shapes if _rules.template(k)[0] in kept}
    if names != set(shapes):
        fn(model, names)
    return model


def drop_copies(fmt, model, recipes: dict, stored: set[str], twin_names) -> tuple[dict, set[str], list[str]]:
    """The recipes without the destination tensors that repeat, whole and as they are, a source
    tensor another recipe already copies whole, where ``fmt``'s loader builds its model without them.

    Args:
        fmt: the destination's format.
        model: the destination twin (changed in place by the loader's check; not used afterwards).
        recipes: {destination template: Recipe} (``_rules.learn``).
        stored: the destination templates its twin's saver wrote.
        twin_names: the destination twin's parameter names.
    Returns:
        (recipes, stored templates, the templates dropped).
    """
    fn = _dirs.optional(fmt, "port_as_loaded")
    if fn is None:
        return recipes, stored, []

    def plain(r):
        return (r.axis is None and not r.stack and not r.pick and r.view is None and len(r.pieces) == 1
                and not r.pieces[0].transpose and not r.offset)

    by_source: dict[str, list[str]] = {}
    for t, r in recipes.items():
        if plain(r):
            by_source.setdefault(r.pieces[0].source, []).append(t)
    copies = [ts for ts in by_source.values() if len(ts) > 1]
    if not copies:
        return recipes, stored, []
    names = set(twin_names)
    dropped: list[str] = []
    for ts in copies:
        kept = len(ts)
        for t in ts:
            if kept == 1:  # one of them is written: the one every loader needs
                break
            without = {k for k in names if _rules.template(k)[0] != t}
            if not any(_rules.template(k)[0] == t for k in fn(model, without)):
                dropped.append(t)
                names, kept = without, kept - 1
    recipes = {t: r for t, r in recipes.items() if t not in dropped}
    return recipes, set(stored) - set(dropped), dropped
