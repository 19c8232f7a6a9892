"""mossvox: api layer."""
