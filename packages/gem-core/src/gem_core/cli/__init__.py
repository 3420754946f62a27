"""The ``gem`` command line. Sub-commands are plugins (kind ``cli``), loaded when invoked."""
