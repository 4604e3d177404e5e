"""ament_python package gemma_spec_ros: speculative-decoding Gemma 4 for ROS 2 planners."""

import os
from glob import glob

from setuptools import find_packages, setup

package_name = 'gemma_spec_ros'
share = os.path.join('share', package_name)


def model_data_files():
    """Install each bundled model directory under share/gemma_spec_ros/models/."""
    entries = []
    for directory, _, files in sorted(os.walk('models')):
        if files:
            entries.append((os.path.join(share, directory), [os.path.join(directory, f) for f in sorted(files)]))
    return entries


commands = ['generate', 'client', 'diag', 'record', 'replay']
# The lab (benchmarks and training) stays in the source checkout, where `python -m gemma_spec_ros bench|train` runs
# it: a robot's install holds only what serves the node (test_package checks the built tree).
LAB = ['gemma_spec_ros.benchmarks', 'gemma_spec_ros.benchmarks.*', 'gemma_spec_ros.train', 'gemma_spec_ros.train.*']

setup(
    name=package_name,
    version='0.1.0',
    packages=find_packages(exclude=['test', 'test.*'] + LAB),
    package_data={'gemma_spec_ros.engine.runtime.ops': ['*.cpp', '*.h']},  # cpu_ops.py's C++ ops, built on use
    data_files=[
        ('share/ament_index/resource_index/packages', ['resource/' + package_name]),
        (share, ['package.xml']),
        (os.path.join(share, 'launch'), glob('launch/*.launch.py')),
        (os.path.join(share, 'config'), glob('config/*.yaml') + glob('config/*.xml') + glob('config/*.json')),
    ] + model_data_files(),
    install_requires=['setuptools'],
    zip_safe=True,
    maintainer='gemma_spec_ros maintainers',
    maintainer_email='maintainers@gemma-spec-ros.dev',
    description='Lossless speculative decoding of Gemma 4 behind a ROS 2 action server.',
    license='Apache-2.0',
    entry_points={
        'console_scripts': [
            'gemma_spec_node = gemma_spec_ros.__main__:node_main',
        ] + ['{0} = gemma_spec_ros.__main__:{0}_main'.format(name) for name in commands],
    },
)
