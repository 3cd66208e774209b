"""Where the daemon's events go: the JSON log (``logs``), Prometheus (``metrics``) and MQTT
alerts (``alerts``). A sink's ``emit`` never blocks and never raises; sinks never import
each other."""
