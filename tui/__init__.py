"""memra-tui: the live inspector of memrad's cache decisions (imports no torch)."""
