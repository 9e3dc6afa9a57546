"""Change-mask annotation in Label Studio: tasks out, brush/polygon masks back in, agreement, proposals."""
