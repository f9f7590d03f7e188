"""The internals every part of pockjax uses: jaxpr helpers, update ordering ties,
public names' home module. Nothing here is public."""
