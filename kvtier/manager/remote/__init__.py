"""The manager's side of the shared tier: presence lookups, promotions and write-back
(:mod:`.tier`), and the notice when blocks leave CPU memory before their write (:mod:`.lag`)."""
