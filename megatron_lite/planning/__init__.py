"""Layout planning: per-rank memory and step time predicted from a configuration, before any launch."""
