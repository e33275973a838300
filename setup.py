from pathlib import Path

from setuptools import find_packages, setup

version = {}
for line in Path("fsdp_passes/__init__.py").read_text().splitlines():
    if line.startswith("__version__"):
        version["v"] = line.split("=")[1].strip().strip('"')

setup(
    name="fsdp_passes",
    version=version["v"],
    description="Bucketing and overlap scheduling of FSDP collectives as PyTorch Inductor passes",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["fsdp_passes", "fsdp_passes.*"]),
    package_data={"fsdp_passes.cost_model": ["profiles/*.json"]},
    install_requires=[
        # the passes hook into Inductor internals that this release line provides
        "torch>=2.13.0,<2.14",
        "networkx>=3.0",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "hypothesis>=6",
            "pytest-xdist==3.8.0",  # the suite runs one worker per core, each test file in one worker
            # third-party model tier (tests/models): small random configurations, nothing downloaded at run time;
            # torchtitan itself is installed by dev.sh with --no-deps (its data-loading and logging
            # dependencies are not needed), these are what its model and SimpleFSDP imports need
            "transformers==5.23.0",
            "tyro==1.0.17",
            "einops==0.8.2",
            "spmd_types==0.2.3",
        ],
        "plot": ["matplotlib>=3.7"],
    },
    entry_points={"console_scripts": ["fsdp-passes=fsdp_passes.__main__:main"]},
)
