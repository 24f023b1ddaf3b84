"""The extract stage: regenerate replies with the served target and capture its aux hidden states into features."""
