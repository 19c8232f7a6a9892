"""mossvox: ipc layer."""
