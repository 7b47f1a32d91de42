"""What operators and tools see of kvtier: the event stream (:mod:`.events`), Prometheus
metrics (:mod:`.metrics`) and the per-step timeline of a hit (:mod:`.timeline`)."""
