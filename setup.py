"""ament_python package gemma_spec_ros: speculative-decoding Gemma 4 for ROS 2 planners."""

from glob import glob

from setuptools import find_packages, setup

package_name = 'gemma_spec_ros'
commands = ['generate', 'client', 'diag', 'record', 'replay', 'train', 'bench']

setup(
    name=package_name,
    version='0.1.0',
    packages=find_packages(exclude=['test']),
    data_files=[
        ('share/ament_index/resource_index/packages', ['resource/' + package_name]),
        ('share/' + package_name, ['package.xml']),
        ('share/' + package_name + '/launch', glob('launch/*.launch.py')),
        ('share/' + package_name + '/config', glob('config/*.yaml')),
    ],
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
