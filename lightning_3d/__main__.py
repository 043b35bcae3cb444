from lightning_3d.cli import main

main()
