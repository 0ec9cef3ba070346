"""Optional integrations. Each imports its framework; the core never imports them."""
