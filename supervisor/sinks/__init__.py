"""Where the daemon's events go: the JSON log (``logs``), Prometheus (``metrics``, served by
``metrics_endpoint``) and MQTT alerts (``alerts``, delivered by ``adapters.mqtt``). A sink's
``emit`` never blocks and never raises; sinks never import each other."""
