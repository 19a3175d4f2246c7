import sys

try:  # Ctrl-C while torch and Hydra are still importing: one line too (zoo.cli.command handles the rest)
    from zoo.cli import main
except KeyboardInterrupt:
    print("zoo: interrupted", file=sys.stderr)
    sys.exit(130)

main()
