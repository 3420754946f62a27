"""The file a cluster user hands to ``spark-submit``: ``gem data import --engine spark`` with the
given arguments, on the session spark-submit starts (its ``--master``, ``--driver-memory``, ...)::

    spark-submit --master spark://head:7077 \\
        $(python -c 'import gem_data.spark_submit as m; print(m.__file__)') \\
        --impressions ... --events ... --schema ... --out ... --temp-dir /shared/scratch

``python -m gem_data.spark_submit --help`` lists the options. It is its own module, apart from
the engine (:mod:`gem_data.import_spark`), because it runs the command, which chooses among
the engines.
"""

from __future__ import annotations

import sys

from gem_data.importer import import_command


def main(argv: list[str] | None = None) -> None:
    """Run ``gem data import --engine spark`` with ``argv`` (default: the process's)."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--engine" or a.startswith("--engine=") for a in arguments):
        sys.exit("Error: --engine: this entry point always runs --engine spark")
    import_command.main(["--engine", "spark", *arguments],
                        prog_name="spark-submit gem_data/spark_submit.py")


if __name__ == "__main__":
    main()
