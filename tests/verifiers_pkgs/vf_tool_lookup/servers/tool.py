import verifiers.v1 as vf


class LookupToolset(vf.Toolset[vf.SharedToolsetConfig]):
    @vf.tool
    def spell_backwards(self, text: str) -> str:
        """The text spelled backwards."""
        return text[::-1]


if __name__ == "__main__":
    LookupToolset.run()
