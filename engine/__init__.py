"""mossvox: engine layer."""
