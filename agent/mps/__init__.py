"""MPS control daemons: one per MPS resource (one per MIG device for MIG), started, limited, supervised."""
