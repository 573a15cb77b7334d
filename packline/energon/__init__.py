"""Energon glue: the conversation sample type and its cooker (more arrives with packing)."""
