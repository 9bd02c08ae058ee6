"""Who comes next: per-workflow predictions of the next K agents and of the workflow's end."""
