"""The layout planner (`rp.plan`): hardware profiles, layouts, the time model, the search."""
