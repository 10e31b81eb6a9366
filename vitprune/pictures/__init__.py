"""Pictures of what a pruned model keeps (matplotlib, imported when a figure is drawn)."""
